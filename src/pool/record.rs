//! Object records: the page-table slot of an object's first page describes the
//! object, so a sidecar that restarts can rebuild its registry from the pool.
//!
//! ```text
//! slot (PAGE_SLOT_BYTES = 128 bytes, little-endian)
//!   0  version u32      bumped when the pages are freed (readers compare it)
//!   4  flags u32        bit 0: the payload crc32 is present
//!   8  payload crc32
//!  12  state u8         0 free (or tombstone), 1 writing, 2 committed
//!  13  name_inline u8   1: tenant and key are in the slot; 0: after the payload
//!  14  key_len u16
//!  16  tenant_len u16
//!  18  reserved (6 bytes, zero)
//!  24  generation u64   of the region when the record was written
//!  32  seq u64          commit order on this node (0 while writing)
//!  40  length u64       payload bytes
//!  48  name: tenant bytes, then key bytes (NAME_INLINE bytes)
//! 124  crc32 of bytes 4..124
//! ```
//! Names longer than `NAME_INLINE` follow the payload in the object's own
//! pages (the reservation is that much larger), so keys are never truncated.
use crate::error::{Error, Result};

pub const SLOT: usize = 128;
/// Tenant plus key bytes kept in the slot itself (an LMCache key in the
/// plugin's encoding is ~66 bytes).
pub const NAME_INLINE: usize = 76;
const CRC_AT: usize = 124;
/// The generation's bytes in a slot.
pub const GENERATION: std::ops::Range<usize> = 24..32;
/// The record checksum's bytes in a slot.
pub const CHECKSUM: std::ops::Range<usize> = CRC_AT..SLOT;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    Writing = 1,
    Committed = 2,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRecord {
    pub state: RecordState,
    pub tenant: String,
    pub key: Vec<u8>,
    pub generation: u64,
    pub seq: u64,
    pub length: u64,
    pub payload_crc: Option<u32>,
}

/// Bytes a record's name takes after the payload (0 when it fits the slot).
pub fn overflow_len(tenant: &str, key: &[u8]) -> u64 {
    let n = tenant.len() + key.len();
    if n <= NAME_INLINE {
        0
    } else {
        n as u64
    }
}

/// Turn an encoded record being written into a committed one.
pub fn commit_in_place(b: &mut [u8; SLOT], seq: u64, payload_crc: Option<u32>) {
    b[4..8].copy_from_slice(&(payload_crc.is_some() as u32).to_le_bytes());
    b[8..12].copy_from_slice(&payload_crc.unwrap_or(0).to_le_bytes());
    b[12] = RecordState::Committed as u8;
    b[32..40].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&b[4..CRC_AT]);
    b[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
}

/// Rewrite an encoded record's generation (a restart renews the region).
pub fn set_generation(b: &mut [u8; SLOT], generation: u64) {
    b[24..32].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32fast::hash(&b[4..CRC_AT]);
    b[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
}

/// A region's records restamped from one generation to the next, each
/// without computing its checksum again: for messages of one length a
/// CRC-32 is affine, crc(m ^ d) = crc(m) ^ crc(d) ^ crc(0), and `d` (the
/// two generations XORed in the generation field) is the same for every
/// record of the region. A rebuild restamps a million records.
pub struct Restamp {
    from: u64,
    to: u64,
    crc_delta: u32,
}

impl Restamp {
    pub fn new(from: u64, to: u64) -> Self {
        let mut d = [0u8; CRC_AT - 4];
        d[20..28].copy_from_slice(&(from ^ to).to_le_bytes());
        Self { from, to, crc_delta: crc32fast::hash(&d) ^ crc32fast::hash(&[0u8; CRC_AT - 4]) }
    }

    /// Restamp `b`, a record of generation `from` (one of another
    /// generation gets its checksum computed). A record whose checksum
    /// did not hold keeps one that does not.
    pub fn apply(&self, b: &mut [u8; SLOT]) {
        if u64::from_le_bytes(b[24..32].try_into().expect("8 bytes")) != self.from {
            return set_generation(b, self.to);
        }
        let crc = u32::from_le_bytes(b[CRC_AT..].try_into().expect("4 bytes"));
        b[24..32].copy_from_slice(&self.to.to_le_bytes());
        b[CRC_AT..].copy_from_slice(&(crc ^ self.crc_delta).to_le_bytes());
    }
}

/// A record's fields, borrowed: what a writer encodes without copying the
/// name first (an allocation takes a lock, and with software coherence a
/// locked instruction waits for the records written back before it).
#[derive(Debug, Clone, Copy)]
pub struct RecordRef<'a> {
    pub state: RecordState,
    pub tenant: &'a str,
    pub key: &'a [u8],
    pub generation: u64,
    pub seq: u64,
    pub length: u64,
    pub payload_crc: Option<u32>,
}

impl<'a> From<&'a ObjectRecord> for RecordRef<'a> {
    fn from(r: &'a ObjectRecord) -> Self {
        let ObjectRecord { state, ref tenant, ref key, generation, seq, length, payload_crc } = *r;
        RecordRef { state, tenant, key, generation, seq, length, payload_crc }
    }
}

impl RecordRef<'_> {
    pub fn to_owned(&self) -> ObjectRecord {
        let RecordRef { state, tenant, key, generation, seq, length, payload_crc } = *self;
        ObjectRecord { state, tenant: tenant.to_owned(), key: key.to_vec(), generation, seq, length, payload_crc }
    }

    /// Bytes 4..SLOT of the slot (the version word is the owner's to bump);
    /// the overflow name, if any, is returned for the caller to place.
    pub fn encode(&self) -> ([u8; SLOT], Option<Vec<u8>>) {
        let mut b = [0u8; SLOT];
        b[4..8].copy_from_slice(&(self.payload_crc.is_some() as u32).to_le_bytes());
        b[8..12].copy_from_slice(&self.payload_crc.unwrap_or(0).to_le_bytes());
        b[12] = self.state as u8;
        let inline = overflow_len(self.tenant, self.key) == 0;
        b[13] = inline as u8;
        b[14..16].copy_from_slice(&(self.key.len() as u16).to_le_bytes());
        b[16..18].copy_from_slice(&(self.tenant.len() as u16).to_le_bytes());
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.seq.to_le_bytes());
        b[40..48].copy_from_slice(&self.length.to_le_bytes());
        let (t, k) = (self.tenant.as_bytes(), self.key);
        let overflow = if inline {
            b[48..48 + t.len()].copy_from_slice(t);
            b[48 + t.len()..48 + t.len() + k.len()].copy_from_slice(k);
            None
        } else {
            Some([t, k].concat())
        };
        let crc = crc32fast::hash(&b[4..CRC_AT]);
        b[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        (b, overflow)
    }
}

impl ObjectRecord {
    /// See [`RecordRef::encode`].
    pub fn encode(&self) -> ([u8; SLOT], Option<Vec<u8>>) {
        RecordRef::from(self).encode()
    }

    /// `Ok(None)` for a free slot (or tombstone). A damaged record is an
    /// error. `overflow` reads `n` name bytes that follow the payload.
    pub fn decode(b: &[u8; SLOT], overflow: impl FnOnce(u64, usize) -> Result<Vec<u8>>) -> Result<Option<Self>> {
        Self::decode_ref(b, overflow, |r| r.to_owned())
    }

    /// `decode`, the record handed to `f` borrowed: an inline name is read
    /// in place, not copied (a rebuild decodes a million records).
    pub fn decode_ref<T>(
        b: &[u8; SLOT],
        overflow: impl FnOnce(u64, usize) -> Result<Vec<u8>>,
        f: impl FnOnce(RecordRef<'_>) -> T,
    ) -> Result<Option<T>> {
        let state = match b[12] {
            0 => return Ok(None),
            1 => RecordState::Writing,
            2 => RecordState::Committed,
            s => return Err(Error::corrupt(format!("object record state {s}"))),
        };
        let want = u32::from_le_bytes(b[CRC_AT..].try_into().expect("4 bytes"));
        if crc32fast::hash(&b[4..CRC_AT]) != want {
            return Err(Error::corrupt("object record checksum mismatch"));
        }
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes")) as usize;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let (key_len, tenant_len, length) = (u16_at(14), u16_at(16), u64_at(40));
        let long;
        let name = match b[13] {
            1 if key_len + tenant_len <= NAME_INLINE => &b[48..48 + tenant_len + key_len],
            0 if key_len + tenant_len > NAME_INLINE => {
                long = overflow(length, tenant_len + key_len)?;
                &long[..]
            }
            _ => return Err(Error::corrupt("object record name does not fit its place")),
        };
        let tenant = std::str::from_utf8(&name[..tenant_len])
            .map_err(|_| Error::corrupt("object record tenant is not UTF-8"))?;
        let has_crc = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) & 1 != 0;
        Ok(Some(f(RecordRef {
            state,
            tenant,
            key: &name[tenant_len..],
            generation: u64_at(24),
            seq: u64_at(32),
            length,
            payload_crc: has_crc.then(|| u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"))),
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(key_len: usize, tenant: &str) -> ObjectRecord {
        ObjectRecord {
            state: RecordState::Committed,
            tenant: tenant.into(),
            key: (0..key_len).map(|i| i as u8).collect(),
            generation: 7,
            seq: 42,
            length: 3 << 20,
            payload_crc: Some(0xDEAD_BEEF),
        }
    }

    #[test]
    fn records_round_trip_inline_and_overflowing_names() {
        for (k, t) in [(1, ""), (66, "salt"), (NAME_INLINE, ""), (NAME_INLINE, "x"), (1024, "tenant")] {
            let r = rec(k, t);
            let (b, over) = r.encode();
            assert_eq!(over.is_some(), k + t.len() > NAME_INLINE);
            let got = ObjectRecord::decode(&b, |len, n| {
                assert_eq!(len, r.length);
                let o = over.clone().unwrap();
                assert_eq!(o.len(), n);
                Ok(o)
            })
            .unwrap();
            assert_eq!(got, Some(r));
        }
        assert_eq!(ObjectRecord::decode(&[0; SLOT], |_, _| unreachable!()).unwrap(), None);
    }

    #[test]
    fn every_flipped_bit_of_a_record_is_caught() {
        let (b, _) = rec(66, "").encode();
        for byte in 4..SLOT {
            for bit in 0..8 {
                let mut bad = b;
                bad[byte] ^= 1 << bit;
                match ObjectRecord::decode(&bad, |_, n| Ok(vec![0; n])) {
                    Err(_) => {}
                    // Clearing the state byte turns it into a free slot: never an object.
                    Ok(None) if byte == 12 => {}
                    other => panic!("flip of bit {bit} in byte {byte} not caught: {other:?}"),
                }
            }
        }
    }

    proptest::proptest! {
        /// A restamped record decodes as one encoded with the new generation
        /// (the checksum's shortcut is exact), and a damaged one stays damaged.
        #[test]
        fn a_restamp_is_a_record_encoded_with_the_new_generation(
            key_len in 0usize..NAME_INLINE, from: u64, to: u64, seq: u64, length: u64,
            flip in 32usize..CRC_AT * 8,
        ) {
            let r = ObjectRecord { generation: from, seq, length, ..rec(key_len, "") };
            let (mut b, _) = r.encode();
            let mut damaged = b;
            damaged[flip / 8] ^= 1 << (flip % 8);
            let restamp = Restamp::new(from, to);
            restamp.apply(&mut b);
            let want = ObjectRecord { generation: to, ..r.clone() };
            proptest::prop_assert_eq!(b, want.encode().0);
            // (A flipped generation is another generation's record, and a
            // cleared state byte a free slot: neither is restamped.)
            if !(24..32).contains(&(flip / 8)) && flip / 8 != 12 {
                restamp.apply(&mut damaged);
                proptest::prop_assert!(ObjectRecord::decode(&damaged, |_, n| Ok(vec![0; n])).is_err());
            }
        }
    }
}
