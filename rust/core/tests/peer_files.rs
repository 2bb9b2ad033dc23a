//! Peer files (`dask_shm_core::peer`) written by a real `FileStore`: an
//! integration test, so that `peer` itself does not depend on `store` (the
//! store uses `peer`).

use std::io;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};

use dask_shm_core::peer::{open_peer_file, user_dir, PeerError};
use dask_shm_core::store::{FileStore, PutOutcome};

fn spill_file(root: &Path) -> (FileStore, PathBuf, u64) {
    let store = FileStore::open(user_dir(root).join("w1")).unwrap();
    let PutOutcome::Stored { name, disk } =
        store.put("k", &[b"abc", &[5u8; 100]], 1, None).unwrap()
    else {
        panic!("not stored")
    };
    let path = store.path_of(&name);
    (store, path, disk)
}

/// A fresh root (a directory in a temporary one) holding one spill file:
/// the temporary directory, the root, the store, the file's path and size.
fn root_with_spill_file() -> (tempfile::TempDir, PathBuf, FileStore, PathBuf, u64) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let (store, path, disk) = spill_file(&root);
    (tmp, root, store, path, disk)
}

#[test]
fn a_genuine_file_is_accepted_and_linkable() {
    let tmp = tempfile::tempdir().unwrap();
    let (_store, path, disk) = spill_file(tmp.path());
    let peer = open_peer_file(tmp.path(), &path, disk).unwrap();
    assert_eq!(peer.layout.frames.len(), 2);
    let dest = tmp.path().join("linked");
    peer.link_to(&dest).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().nlink(), 2);
    // never replaces an existing file
    assert_eq!(
        peer.link_to(&dest).unwrap_err().kind(),
        io::ErrorKind::AlreadyExists
    );
}

#[test]
fn forgeries_are_refused() {
    let (_tmp, root, _store, path, disk) = root_with_spill_file();
    let outside = tempfile::tempdir().unwrap();
    let (_other, foreign, foreign_disk) = spill_file(outside.path());
    let forged_kind =
        |p: &Path, size: u64| matches!(open_peer_file(&root, p, size), Err(PeerError::Forged(_)));
    assert!(forged_kind(&foreign, foreign_disk), "outside the root");
    assert!(forged_kind(&path, disk + 1), "wrong size");
    let link = user_dir(&root).join("w1").join("sym");
    symlink(&path, &link).unwrap();
    assert!(forged_kind(&link, disk), "symlink");
    let dir_link = user_dir(&root).join("escape");
    symlink(outside.path(), &dir_link).unwrap();
    let via = dir_link.join(foreign.file_name().unwrap());
    assert!(forged_kind(&via, foreign_disk), "directory symlink out");
    let dotdot = user_dir(&root).join("w1/../../x");
    assert!(forged_kind(&dotdot, 1), "dot-dot");
    assert!(forged_kind(Path::new("relative"), 1), "relative");
    let junk = user_dir(&root).join("junk");
    std::fs::write(&junk, vec![0u8; 200]).unwrap();
    assert!(forged_kind(&junk, 200), "not a spill file");
    assert!(
        forged_kind(&user_dir(&root).join("w1"), 4096),
        "a directory"
    );
    // a genuine file of ours under the root but outside our user directory
    let (_beside, beside, beside_disk) = spill_file(&root.join("elsewhere"));
    let moved = root.join("elsewhere-file");
    std::fs::hard_link(&beside, &moved).unwrap();
    assert!(forged_kind(&moved, beside_disk), "outside dask-shm-<uid>");
}

#[test]
fn symlinks_that_stay_inside_the_user_directory_are_accepted() {
    let (tmp, root, _store, path, disk) = root_with_spill_file();
    // a directory alias inside dask-shm-<uid>
    let alias = user_dir(&root).join("alias");
    symlink(user_dir(&root).join("w1"), &alias).unwrap();
    let via_alias = alias.join(path.file_name().unwrap());
    assert!(open_peer_file(&root, &via_alias, disk).is_ok());
    // the root named through a symlink, the path spelled either way
    let root_alias = tmp.path().join("root-alias");
    symlink(&root, &root_alias).unwrap();
    assert!(open_peer_file(&root_alias, &path, disk).is_ok());
    let spelled = user_dir(&root_alias)
        .join("w1")
        .join(path.file_name().unwrap());
    assert!(open_peer_file(&root, &spelled, disk).is_ok());
    assert!(open_peer_file(&root_alias, &spelled, disk).is_ok());
}
