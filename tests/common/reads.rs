//! The client's own mapping of the pool, and what a test reads back
//! through it and through InlineGet: a copy re-checked after it is made,
//! and whose bytes a wrong read returned (the cluster fault tests).
use cxlkv::client::Client;
use cxlkv::proto;

use super::{exists, key, lookup, unlock};

/// The client's own mapping of the pool (the zero-copy data path).
pub struct PoolMap {
    map: memmap2::MmapMut,
    info: proto::PoolInfoReply,
}

impl PoolMap {
    pub async fn open(c: &mut Client) -> Self {
        let info = c.pool_info(proto::PoolInfoRequest {}).await.unwrap().into_inner();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&info.path).unwrap();
        // SAFETY (test): the file is a live pool; the test only touches
        // reserved or locked ranges.
        let map = unsafe { memmap2::MmapOptions::new().len(info.pool_size as usize).map_mut(&f).unwrap() };
        Self { map, info }
    }
    fn at(&self, l: &proto::Location) -> usize {
        (self.info.data_offset + l.region as u64 * self.info.region_size + l.offset) as usize
    }
    pub fn write(&mut self, l: &proto::Location, data: &[u8]) {
        assert_eq!(l.length as usize, data.len());
        let o = self.at(l);
        self.map[o..o + data.len()].copy_from_slice(data);
    }
    pub fn read(&self, l: &proto::Location) -> Vec<u8> {
        let o = self.at(l);
        self.map[o..o + l.length as usize].to_vec()
    }
    /// Where the object's first page's slot is, in the pool's page table.
    fn slot_at(&self, l: &proto::Location) -> usize {
        let i = &self.info;
        let page = l.region as u64 * (i.region_size / i.page_size) + l.offset / i.page_size;
        (i.page_table_offset + page * i.page_slot_bytes as u64) as usize
    }
    /// The version word of the object's first page, from the pool's page table.
    pub fn version(&self, l: &proto::Location) -> u32 {
        let o = self.slot_at(l);
        u32::from_le_bytes(self.map[o..o + 4].try_into().unwrap())
    }
    /// Move that version word, as the page's owner does when it lets the
    /// pages go (behind the registry's back, if the test does it).
    pub fn set_version(&mut self, l: &proto::Location, v: u32) {
        let o = self.slot_at(l);
        self.map[o..o + 4].copy_from_slice(&v.to_le_bytes());
    }
}

impl PoolMap {
    /// The generation word of region `r` in the pool's region table.
    pub fn generation(&self, r: u32) -> u64 {
        let i = &self.info;
        let o = (i.region_table_offset + r as u64 * i.region_entry_bytes as u64 + 8) as usize;
        u64::from_le_bytes(self.map[o..o + 8].try_into().unwrap())
    }

    /// A reader's copy: the bytes, then the object's version word and its
    /// region's generation read again after the copy; None when either
    /// moved (the copy may hold another object's bytes: a miss).
    pub fn read_checked(&self, l: &proto::Location) -> Option<Vec<u8>> {
        let data = self.read(l);
        (self.version(l) == l.version && self.generation(l.region) == l.generation).then_some(data)
    }
}

/// One mapped read of a key through a node.
pub enum Mapped {
    Miss,
    /// Found, copied, and still the object it was when handed out.
    Bytes(Vec<u8>),
    /// Found, but the version word or the region's generation had moved by
    /// the end of the copy (while the lookup's lock was held).
    Moved(proto::Location),
}

/// Lookup (lock) `k` through `c`, copy it from the mapping with the version
/// re-checked after the copy, unlock.
pub async fn mapped_get(c: &mut Client, m: &PoolMap, k: &str) -> Mapped {
    let Some(l) = lookup(c, &[k]).await.remove(0) else { return Mapped::Miss };
    let out = match m.read_checked(&l) {
        Some(b) => Mapped::Bytes(b),
        None => Mapped::Moved(l),
    };
    unlock(c, &[k]).await;
    out
}

/// InlineGet of `k`: Ok(None) on a miss; the stream's error (e.g. ABORTED:
/// the object went away while it was read) as Err.
pub async fn inline_get_result(c: &mut Client, k: &str) -> Result<Option<Vec<u8>>, tonic::Status> {
    use proto::inline_get_chunk::Part;
    let mut s = c.inline_get(proto::InlineGetRequest { key: key(k) }).await?.into_inner();
    let Some(Part::Header(h)) = s.message().await?.and_then(|m| m.part) else {
        return Err(tonic::Status::internal("no header"));
    };
    if !h.found {
        return Ok(None);
    }
    let mut out = vec![];
    while let Some(m) = s.message().await? {
        let Some(Part::Data(d)) = m.part else { return Err(tonic::Status::internal("unexpected part")) };
        out.extend_from_slice(&d);
    }
    Ok(Some(out))
}

/// Whose bytes these are, for failure messages: the name of the first of
/// `known` with exactly these bytes, else how many of their 4 KiB blocks
/// are blocks of which known payload (a writer that went on writing into
/// pages that became another object's).
pub fn whose(bytes: &[u8], known: &[(String, Vec<u8>)]) -> String {
    const BLOCK: usize = 4096;
    if let Some((k, _)) = known.iter().find(|(_, v)| v[..] == *bytes) {
        return format!("the bytes of {k}");
    }
    let blocks = bytes.len() / BLOCK;
    let best = known
        .iter()
        .map(|(k, v)| {
            let theirs: std::collections::HashSet<&[u8]> = v.chunks_exact(BLOCK).collect();
            (bytes.chunks_exact(BLOCK).filter(|b| theirs.contains(b)).count(), k)
        })
        .max_by_key(|(n, _)| *n);
    match best {
        Some((n, k)) if n > 0 => format!("{n} of its {blocks} 4 KiB blocks are bytes of {k}"),
        _ => format!("{} bytes of no known key", bytes.len()),
    }
}

/// Read every key of `want` through `c` (named `node`), mapped (version
/// re-checked after the copy) and by InlineGet, and every key of `gone`
/// (lookup, Exists, InlineGet): one line per read that is not exactly the
/// key's own bytes (or, for `gone`, a miss). `known`: every payload the test
/// wrote, to name whose bytes a wrong read returned.
pub async fn misreads(
    node: &str,
    c: &mut Client,
    m: &PoolMap,
    want: &[(String, Vec<u8>)],
    gone: &[&str],
    known: &[(String, Vec<u8>)],
) -> Vec<String> {
    let mut out = vec![];
    for (k, v) in want {
        match mapped_get(c, m, k).await {
            Mapped::Bytes(b) if b == *v => {}
            Mapped::Bytes(b) => out.push(format!("{k} through {node} (mapped): {}", whose(&b, known))),
            Mapped::Miss => out.push(format!("{k} through {node} (mapped): a miss")),
            Mapped::Moved(l) => out.push(format!("{k} through {node} (mapped): its location moved under a lock {l:?}")),
        }
        match inline_get_result(c, k).await {
            Ok(Some(b)) if b == *v => {}
            Ok(Some(b)) => out.push(format!("{k} through {node} (InlineGet): {}", whose(&b, known))),
            Ok(None) => out.push(format!("{k} through {node} (InlineGet): a miss")),
            Err(s) => out.push(format!("{k} through {node} (InlineGet): {s:?}")),
        }
    }
    for k in gone {
        match mapped_get(c, m, k).await {
            Mapped::Miss => {}
            Mapped::Bytes(b) => out.push(format!("{k} through {node} (mapped): found, {}", whose(&b, known))),
            Mapped::Moved(l) => out.push(format!("{k} through {node} (mapped): found at a moved location {l:?}")),
        }
        if exists(c, &[k]).await != [false] {
            out.push(format!("{k} through {node}: Exists true"));
        }
        match inline_get_result(c, k).await {
            Ok(None) => {}
            Ok(Some(b)) => out.push(format!("{k} through {node} (InlineGet): found, {}", whose(&b, known))),
            Err(s) => out.push(format!("{k} through {node} (InlineGet): {s:?}")),
        }
    }
    out
}
