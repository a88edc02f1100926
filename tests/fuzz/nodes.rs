//! Target `nodes`: the pool's node table (cluster mode: node name → id, in
//! the superblock's 4 KiB) as someone else wrote it, read by `Pool::nodes`
//! and extended by `Pool::node_id_for`.
//!
//! Input: `[flags][name byte][table bytes]`. The table bytes are written at
//! the table's place in a freshly formatted pool. Flags bit 0 shapes each
//! 64-byte entry (a small id, a name length of at most 56), so inputs reach
//! past the cheap checks. Checks: nothing panics; a table is read with
//! unique ids (1..=MAX_NODES) and unique names of at most 56 bytes, or is
//! refused as `Corrupt`; a name added gets an id no other name has, the
//! same one when asked again, and the table then reads with it.
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use cxlkv::error::ErrorKind;
use cxlkv::pool::{Geometry, Pool, PoolOptions, ShmBackend, MAX_NODES, MAX_NODE_NAME};

use crate::driver::{norm, Target};

/// Where the table starts in the pool file, and its entries' size.
const TABLE_AT: u64 = 1024;
const ENTRY: usize = 64;

pub struct NodesTarget {
    _dir: tempfile::TempDir,
    path: PathBuf,
    g: Geometry,
}

impl NodesTarget {
    pub fn new() -> Self {
        let dir = crate::scratch_dir();
        let g = Geometry::for_capacity(4 << 20, 2 << 20, 64 << 10, 2 << 20).unwrap();
        let path = dir.path().join("pool");
        let backend = ShmBackend::open(&path, g.pool_size, false).unwrap();
        let opts = PoolOptions { region_size: g.region_size, page_size: g.page_size, format: true };
        drop(Pool::open(Box::new(backend), &opts).unwrap());
        Self { _dir: dir, path, g }
    }
}

fn entry(id: u32, name: &str) -> Vec<u8> {
    let mut e = vec![0u8; ENTRY];
    e[..4].copy_from_slice(&id.to_le_bytes());
    e[4..8].copy_from_slice(&(name.len() as u32).to_le_bytes());
    e[8..8 + name.len()].copy_from_slice(name.as_bytes());
    e
}

impl Target for NodesTarget {
    fn name(&self) -> &'static str {
        "nodes"
    }
    fn max_len(&self) -> usize {
        2 + MAX_NODES as usize * ENTRY
    }
    fn seeds(&self) -> Vec<Vec<u8>> {
        let table = |entries: &[(u32, &str)]| {
            let mut v = vec![0, b'c'];
            for (id, n) in entries {
                v.extend(entry(*id, n));
            }
            v
        };
        vec![
            vec![0, b'a'],
            table(&[(1, "node-a"), (2, "node-b")]),
            table(&[(1, "node-a"), (1, "node-b")]),
            table(&[(3, "x"), (0, "gone"), (2, "y")]),
        ]
    }

    fn run(&mut self, data: &[u8]) -> String {
        let flags = data.first().copied().unwrap_or(0);
        let name = format!("node-{}", data.get(1).copied().unwrap_or(0) % 8);
        let mut table = vec![0u8; MAX_NODES as usize * ENTRY];
        let src = data.get(2..).unwrap_or(&[]);
        let n = src.len().min(table.len());
        table[..n].copy_from_slice(&src[..n]);
        if flags & 1 != 0 {
            for e in table.chunks_mut(ENTRY) {
                let id = u32::from_le_bytes(e[..4].try_into().unwrap()) % (MAX_NODES + 2);
                e[..4].copy_from_slice(&id.to_le_bytes());
                let len = u32::from_le_bytes(e[4..8].try_into().unwrap()) % (MAX_NODE_NAME as u32 + 2);
                e[4..8].copy_from_slice(&len.to_le_bytes());
            }
        }
        std::fs::OpenOptions::new().write(true).open(&self.path).unwrap().write_all_at(&table, TABLE_AT).unwrap();
        let backend = ShmBackend::open(&self.path, self.g.pool_size, false).unwrap();
        let opts = PoolOptions { region_size: self.g.region_size, page_size: self.g.page_size, format: false };
        let (pool, _) = Pool::open(Box::new(backend), &opts).expect("the table is not part of what open checks");
        let nodes = match pool.nodes() {
            Ok(n) => n,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
                assert_eq!(pool.node_id_for(&name).unwrap_err().kind(), ErrorKind::Corrupt);
                return format!("refused: {}", norm(e.message()));
            }
        };
        check(&nodes);
        let id = match pool.node_id_for(&name) {
            Ok(id) => id,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::ResourceExhausted, "{e}");
                assert_eq!(nodes.len(), MAX_NODES as usize);
                return "full".into();
            }
        };
        let after = pool.nodes().expect("a table the pool wrote reads back");
        check(&after);
        assert!(after.contains(&(id, name.clone())), "{name} -> {id} is not in the table");
        assert_eq!(pool.node_id_for(&name).unwrap(), id, "asked again, the same id");
        let known = nodes.iter().any(|(_, n)| *n == name);
        format!("read {} nodes, {}", nodes.len().min(4), if known { "known" } else { "added" })
    }
}

fn check(nodes: &[(u32, String)]) {
    for (i, (id, name)) in nodes.iter().enumerate() {
        assert!((1..=MAX_NODES).contains(id), "id {id}");
        assert!(!name.is_empty() && name.len() <= MAX_NODE_NAME, "{name:?}");
        assert!(nodes[..i].iter().all(|(j, n)| j != id && n != name), "{id} {name:?} twice: {nodes:?}");
    }
}
