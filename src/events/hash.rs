//! What a key is to a router: its block hash and its model, for every key
//! shape the LMCache plugin writes (`python/cxlkv_lmcache/keys.py`), and
//! the hashes of the router-sized blocks a chunk's tokens are split into.
//!
//! - `0x01 …` (the multiprocess server's ObjectKey): the chunk hash is bytes;
//!   the block hash is its first 8 bytes, big-endian, signed.
//! - `0x02 …` (the in-process engine's CacheEngineKey, or a layer key): a
//!   hash LMCache made from a Python int (flags bit 1 clear) is that int —
//!   LMCache's ints run from -2^63 (Python's `hash`) to 2^64 - 1
//!   (`sha256_cbor`'s first 8 bytes), so they are carried as a signed or an
//!   unsigned 64-bit int; the key holds it as minimal signed big-endian
//!   bytes, 9 of them from 2^63 on. A hash made of bytes: as for `0x01`.
//! - `0x03 …` (a CacheEngineKey too long for the binary form, its
//!   `to_string()`: `model@world@worker@hash_hex@dtype[@layer][@tags]`) and
//!   the multiprocess text form (`model@rank@group@hash_hex[@salt]`): a hex
//!   hash of at most 16 digits is that int (with its sign), a longer one is
//!   bytes (as above).
//! - Anything else: two CRC-32s (IEEE, zlib's) as one 64-bit signed int,
//!   `crc32(key) << 32 | crc32(key, 0x9E3779B9)` (the second started from
//!   that value, as zlib's `crc32(data, value)`): computed at memory speed
//!   (FNV-1a, byte by byte, cost a fifth of a store's CPU with 1000-byte
//!   keys), and by anyone with zlib.
//!
//! A key whose form is cut short or malformed is anything else.

/// A block hash as vLLM's `ExternalBlockHash` int (msgpack writes a
/// negative one signed, any other unsigned: each as LMCache had it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockHash {
    Negative(i64),
    NonNegative(u64),
}

impl BlockHash {
    pub fn of_i64(v: i64) -> Self {
        if v < 0 {
            Self::Negative(v)
        } else {
            Self::NonNegative(v as u64)
        }
    }

    /// The two's-complement bits (what Dynamo keys on; unique per value in
    /// LMCache's range).
    pub fn bits(self) -> u64 {
        match self {
            Self::Negative(v) => v as u64,
            Self::NonNegative(v) => v,
        }
    }

    /// Back from `bits` and the sign (a relayed event).
    pub fn from_bits(bits: u64, negative: bool) -> Self {
        if negative {
            Self::Negative(bits as i64)
        } else {
            Self::NonNegative(bits)
        }
    }

    pub fn is_negative(self) -> bool {
        matches!(self, Self::Negative(_))
    }

    /// Block `i` of the `n` router blocks a chunk of hash `self` is split
    /// into: the last is the chunk's own hash (so the next chunk, whose
    /// parent is this chunk, chains on to it), each earlier one a 64-bit
    /// mix of the chunk's hash and its index.
    pub fn block(self, i: u32, n: u32) -> Self {
        if i + 1 >= n {
            return self;
        }
        let x = self.bits() ^ u64::from(i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        Self::NonNegative(splitmix64(x))
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A key's block hash and model, parsed once.
pub fn describe(key: &[u8]) -> (BlockHash, &[u8]) {
    parse(key).map_or_else(|| (other(key), &[][..]), |p| (p.hash, p.model))
}

/// A key's block hash (see the module's doc).
pub fn block_hash(key: &[u8]) -> BlockHash {
    parse(key).map_or_else(|| other(key), |p| p.hash)
}

/// The block hash of a key of no plugin form.
fn other(key: &[u8]) -> BlockHash {
    let mut lo = crc32fast::Hasher::new_with_initial(0x9e37_79b9);
    lo.update(key);
    BlockHash::of_i64((u64::from(crc32fast::hash(key)) << 32 | u64::from(lo.finalize())) as i64)
}

/// A key's model name ("" for a key not of the plugin's forms).
pub fn model(key: &[u8]) -> &[u8] {
    parse(key).map_or(&[], |p| p.model)
}

/// What a plugin key says to a router.
struct Parsed<'a> {
    model: &'a [u8],
    hash: BlockHash,
}

fn parse(k: &[u8]) -> Option<Parsed<'_>> {
    match *k.first()? {
        0x01 => binary_mp(k),
        0x02 => binary_engine(k),
        0x03 => text(&k[1..], 3),
        _ => looks_like_mp_text(k).then(|| text(k, 3)).flatten(),
    }
}

/// `0x01 | len(model) | model | i32 kv_rank | u32 group | len(hash) | hash | salt`
fn binary_mp(k: &[u8]) -> Option<Parsed<'_>> {
    let m = usize::from(*k.get(1)?);
    let model = k.get(2..2 + m)?;
    let hash = counted(k, 2 + m + 8)?;
    Some(Parsed { model, hash: of_bytes(hash) })
}

/// `0x02 | flags | len(model) | model | u32 world | u32 worker | dtype
/// | [u32 layer] | len(hash) | hash | tags`
fn binary_engine(k: &[u8]) -> Option<Parsed<'_>> {
    let flags = *k.get(1)?;
    let m = usize::from(*k.get(2)?);
    let model = k.get(3..3 + m)?;
    let at = 3 + m + 9 + if flags & 1 != 0 { 4 } else { 0 };
    let hash = counted(k, at)?;
    let hash = if flags & 2 != 0 { of_bytes(hash) } else { of_int_bytes(hash)? };
    Some(Parsed { model, hash })
}

/// A length byte at `at` and that many bytes after it.
fn counted(k: &[u8], at: usize) -> Option<&[u8]> {
    let n = usize::from(*k.get(at)?);
    k.get(at + 1..at + 1 + n)
}

/// `model@a@b@hash_hex…`: the hash is the `field`-th field (0-based).
fn text(k: &[u8], field: usize) -> Option<Parsed<'_>> {
    let mut parts = k.split(|&b| b == b'@');
    let model = parts.next()?;
    let hex = parts.nth(field - 1)?;
    Some(Parsed { model, hash: of_hex(hex)? })
}

/// The multiprocess text form: `model@{kv_rank:08x}@{group:x}@hash…`.
fn looks_like_mp_text(k: &[u8]) -> bool {
    let Some(at) = memchr::memchr(b'@', k) else { return false };
    let mut parts = k[at..].split(|&b| b == b'@').skip(1);
    let hexish =
        |p: Option<&[u8]>| p.is_some_and(|p| !p.is_empty() && p.iter().all(|&b| b == b'-' || b.is_ascii_hexdigit()));
    hexish(parts.next()) && hexish(parts.next()) && hexish(parts.next())
}

/// A hash made of bytes: its first 8, big-endian, signed (fewer: padded
/// on the left with zeros).
fn of_bytes(h: &[u8]) -> BlockHash {
    let mut b = [0u8; 8];
    let n = h.len().min(8);
    b[8 - n..].copy_from_slice(&h[..n]);
    BlockHash::of_i64(i64::from_be_bytes(b))
}

/// A Python int as minimal signed big-endian bytes (`keys.py`'s
/// `_hash_bytes`), back to the int: 9 bytes for 2^63 and above. An int
/// outside LMCache's 64-bit range keeps its low 64 bits.
fn of_int_bytes(h: &[u8]) -> Option<BlockHash> {
    let negative = *h.first()? & 0x80 != 0;
    let mut b = [if negative { 0xff } else { 0 }; 8];
    let tail = &h[h.len().saturating_sub(8)..];
    b[8 - tail.len()..].copy_from_slice(tail);
    Some(BlockHash::from_bits(u64::from_be_bytes(b), negative))
}

/// A hex hash in a text key: an int of at most 16 digits (its sign kept),
/// else bytes.
fn of_hex(hex: &[u8]) -> Option<BlockHash> {
    let (negative, digits) = match hex.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, hex),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    if digits.len() <= 16 {
        let v = u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()?;
        return Some(if negative { BlockHash::of_i64((v as i64).wrapping_neg()) } else { BlockHash::NonNegative(v) });
    }
    if negative || digits.len() % 2 != 0 {
        return None;
    }
    let byte = |i: usize| u8::from_str_radix(std::str::from_utf8(&digits[i..i + 2]).ok()?, 16).ok();
    let bytes: Option<Vec<u8>> = (0..8).map(|i| byte(2 * i)).collect();
    Some(of_bytes(&bytes?))
}

pub fn fnv1a(k: &[u8]) -> u64 {
    k.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `keys.py`'s `_hash_bytes` for an int.
    fn int_bytes(h: i128) -> Vec<u8> {
        let bits = 128 - if h < 0 { (!h).leading_zeros() } else { h.leading_zeros() };
        let n = ((bits + 8) / 8).max(1) as usize;
        h.to_be_bytes()[16 - n..].to_vec()
    }

    fn engine_key(hash: &[u8], flags: u8, layer: bool) -> Vec<u8> {
        let mut k = vec![0x02, flags | u8::from(layer), 1, b'm', 0, 0, 0, 1, 0, 0, 0, 0, 1];
        if layer {
            k.extend_from_slice(&7u32.to_be_bytes());
        }
        k.push(hash.len() as u8);
        k.extend_from_slice(hash);
        k.extend_from_slice(b"\x0acache_salt\x00\x01x");
        k
    }

    #[test]
    fn an_int_hash_is_that_int_across_lmcaches_whole_range() {
        // Issue #44 (f): 0x8000000000000005 takes 9 bytes; it was announced
        // as its first 8 (hash >> 8).
        let k = hex("0200016d00000000000000000109008000000000000005");
        assert_eq!(block_hash(&k), BlockHash::NonNegative(0x8000_0000_0000_0005));
        for h in [0i128, -5, 5, 255, 256, i64::MIN as i128, i64::MAX as i128, 1 << 63, u64::MAX as i128] {
            for layer in [false, true] {
                let want = if h < 0 { BlockHash::Negative(h as i64) } else { BlockHash::NonNegative(h as u64) };
                assert_eq!(block_hash(&engine_key(&int_bytes(h), 0, layer)), want, "{h} layer {layer}");
            }
        }
    }

    #[test]
    fn a_bytes_hash_is_its_first_eight_bytes_big_endian_signed() {
        let mut k = vec![0x01, 1, b'm', 0, 0, 0, 0, 0, 0, 0, 0, 8];
        k.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        k.extend_from_slice(b"salt");
        assert_eq!(block_hash(&k), BlockHash::NonNegative(0x0102_0304_0506_0708));
        assert_eq!(model(&k), b"m");
        let h: Vec<u8> = (0xd0u8..0xf0).collect();
        let want = BlockHash::of_i64(i64::from_be_bytes(h[..8].try_into().unwrap()));
        assert_eq!(block_hash(&engine_key(&h, 2, false)), want);
    }

    #[test]
    fn text_keys_carry_their_hash_and_model() {
        // 0x03: CacheEngineKey.to_string(), an int hash and a layer key.
        assert_eq!(block_hash(b"\x03model-x@2@1@-5@half"), BlockHash::Negative(-5));
        assert_eq!(
            block_hash(b"\x03m@2@1@8000000000000005@bfloat16@3@k%v"),
            BlockHash::NonNegative(0x8000_0000_0000_0005)
        );
        assert_eq!(model(b"\x03model-x@2@1@-5@half"), b"model-x");
        // The multiprocess text form: model@rank@group@hash_hex[@salt].
        let k = format!("{}@{:08x}@{:x}@{}@salt", "m".repeat(300), 3, 0, "0102030405060708aabb");
        assert_eq!(block_hash(k.as_bytes()), BlockHash::NonNegative(0x0102_0304_0506_0708));
        assert_eq!(model(k.as_bytes()), "m".repeat(300).as_bytes());
    }

    #[test]
    fn any_other_key_is_two_crc32s_and_a_cut_short_form_too() {
        // zlib: crc32(k) << 32 | crc32(k, 0x9E3779B9), as Python computes it.
        assert_eq!(block_hash(b"plain"), BlockHash::NonNegative(0x1920_62cf_dc26_b33d));
        assert_eq!(block_hash(&[b'k'; 1000]), BlockHash::NonNegative(0x72b1_cbab_7763_2da0));
        assert_eq!(model(b"plain"), b"");
        for k in [&[0x01, 200][..], &[0x02, 0, 1, b'm'], b"a@b@c@zz"] {
            assert_eq!(block_hash(k), other(k));
        }
    }

    #[test]
    fn a_chunks_router_blocks_end_with_its_own_hash_and_are_distinct() {
        let h = BlockHash::Negative(-7);
        let blocks: Vec<BlockHash> = (0..16).map(|i| h.block(i, 16)).collect();
        assert_eq!(blocks[15], h);
        let distinct: std::collections::HashSet<u64> = blocks.iter().map(|b| b.bits()).collect();
        assert_eq!(distinct.len(), 16);
        assert_eq!(h.block(0, 1), h);
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }
}
