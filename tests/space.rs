//! The pool file under the sidecar and its clients: a store into a page
//! of it that has no storage raises SIGBUS (a client of the pool is the LLM
//! server). A pool file larger than the room its filesystem has (a
//! container's small /dev/shm is the common case) killed the sidecar; the
//! sidecar now claims only regions it could give storage to, and evicts
//! within them. A second sidecar started with `--format` and another size
//! truncated a pool in use; it is now refused while another process holds
//! a node id on the pool.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// A tmpfs of `size` mounted at `dir` while this lives (needs root, as the
/// network-namespace tests do).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", dir.to_str().unwrap()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "mounting a tmpfs at {} failed (the tests run as root)", dir.display());
        Self(dir.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_pool_larger_than_its_filesystem_evicts_within_the_room_there_is() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&dir.path().join("shm"), "12M");
    let pool = fs.0.join("pool");
    // 64 MiB of pool (32 regions of 2 MiB) on 12 MiB of filesystem.
    let metrics = format!("127.0.0.1:{}", free_port());
    let s = Sidecar::start(
        dir.path(),
        "a",
        &["--pool-path", pool.to_str().unwrap(), "--pool-size", "64MiB", "--eviction-policy", "lru"]
            .into_iter()
            .chain(["--metrics-addr", &metrics])
            .collect::<Vec<_>>(),
    );
    assert!(s.logs().contains("cannot grow to its size"), "no warning at start: {}", s.logs());
    let mut c = s.client().await;
    // This process writes the pages it is handed, as a client does: one
    // without storage would kill it here.
    let mut m = PoolMap::open(&mut c).await;
    for i in 0..48u64 {
        let k = format!("k{i}");
        assert_eq!(store(&mut c, &mut m, "t", &[(&k, pattern(i, 1 << 20))]).await, [OK], "{k}: {}", s.logs());
    }
    let st = stats(&mut c).await;
    assert!((2..6).contains(&st.owned_regions), "owned {} regions of 2 MiB on 12 MiB", st.owned_regions);
    assert!(st.evictions >= 48 - 2 * st.owned_regions as u64, "{st:?}");
    assert!(s.logs().contains("no room for another region"), "{}", s.logs());
    // What an alert rule watches: the bytes the filesystem has no room for.
    let short = || metric::<f64>(&metrics, "cxlkv_pool_room_short_bytes").unwrap_or(0.0);
    eventually("the room shortfall in /metrics", Duration::from_secs(10), async || short() > 32e6).await;
    let latest: Vec<String> = (44..48).map(|i| format!("k{i}")).collect();
    let names: Vec<&str> = latest.iter().map(String::as_str).collect();
    for (i, l) in (44..48u64).zip(lookup(&mut c, &names).await) {
        let l = l.unwrap_or_else(|| panic!("k{i} was evicted although newer than every other key"));
        assert_eq!(m.read(&l), pattern(i, 1 << 20), "k{i}");
    }
    unlock(&mut c, &names).await;
}

#[tokio::test]
async fn a_pool_in_use_is_neither_resized_nor_reformatted_by_another_sidecar() {
    let (dir, s, mut c, mut m) = one_sidecar(&[]).await;
    assert_eq!(store(&mut c, &mut m, "t", &[("k", pattern(7, 100_000))]).await, [OK]);
    let size = std::fs::metadata(&s.pool).unwrap().len();
    for (other, what) in [("--pool-size", "resize"), ("--region-size", "reformat")] {
        // Another sidecar on the same pool file ("b": its own socket).
        let mut b = Sidecar::start_unchecked(dir.path(), what, &[other, "4MiB", "--format"]);
        let status = b.wait_exit(Duration::from_secs(20));
        let err = b.logs();
        assert!(!status.success() && err.contains(&format!("will not {what} pool")), "{what}: {err}");
        assert_eq!(std::fs::metadata(&s.pool).unwrap().len(), size, "{what} changed the pool file's size");
        let l = lookup(&mut c, &["k"]).await.remove(0).expect("the running sidecar still has its key");
        assert_eq!(m.read(&l), pattern(7, 100_000));
        unlock(&mut c, &["k"]).await;
    }
}
