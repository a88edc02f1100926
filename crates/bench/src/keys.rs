//! The keys the benchmarks store: LMCache keys as the plugin encodes them.
//! The plugin's encoder is Python; this is the one other encoder, held to
//! the same bytes by the test below and python/tests/test_keys.py.

/// A key as the LMCache plugin encodes it (binary form, see python/cxlkv_lmcache/keys.py).
pub fn lmcache_key(i: usize) -> Vec<u8> {
    let model = b"meta-llama/Llama-3.1-8B";
    let mut k = vec![1u8, model.len() as u8];
    k.extend_from_slice(model);
    k.extend_from_slice(&0x0201_0201i32.to_be_bytes());
    k.extend_from_slice(&0u32.to_be_bytes());
    k.push(32);
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&(i as u64).to_le_bytes());
    h[8..16].copy_from_slice(&(i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    k.extend_from_slice(&h);
    k
}

#[cfg(test)]
mod tests {
    /// What python/cxlkv_lmcache/keys.py gives for `lmcache_key(i)`'s key, in
    /// hex: the tag, model, rank, group and hash length, then the hash
    /// (python/tests/test_keys.py checks the plugin against the same bytes).
    const PREFIX: &str = "01176d6574612d6c6c616d612f4c6c616d612d332e312d3842020102010000000020";
    const HASHES: [(usize, &str); 3] = [
        (0, "0000000000000000000000000000000000000000000000000000000000000000"),
        (1, "0100000000000000157c4a7fb979379e00000000000000000000000000000000"),
        (123456789, "15cd5b0700000000b9feefc404d071be00000000000000000000000000000000"),
    ];

    #[test]
    fn encodes_as_the_plugin_does() {
        for (i, hash) in HASHES {
            let hex = format!("{PREFIX}{hash}");
            let want: Vec<u8> =
                (0..hex.len()).step_by(2).map(|j| u8::from_str_radix(&hex[j..j + 2], 16).unwrap()).collect();
            assert_eq!(super::lmcache_key(i), want, "key {i}");
        }
    }
}
