//! How figures are reported: one `BENCH <name> <value>` line each, with
//! percentiles, size labels and count tags in their names.

pub fn bench(name: &str, v: f64) {
    println!("BENCH {name} {v:.4}");
}

pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// An object size in a figure's name: `256KiB`, `2MiB`, `100B`.
pub fn label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{}MiB", size >> 20)
    } else if size < 1 << 10 {
        format!("{size}B")
    } else {
        format!("{}KiB", size >> 10)
    }
}

/// A count in a figure's name: `10k`, `1M`.
pub fn count_tag(n: usize) -> String {
    if n >= 1_000_000 {
        format!("{}M", n / 1_000_000)
    } else {
        format!("{}k", n / 1000)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_sizes_and_counts_as_the_figures_have_them() {
        assert_eq!(super::label(100), "100B");
        assert_eq!(super::label(256 << 10), "256KiB");
        assert_eq!(super::label(32 << 20), "32MiB");
        assert_eq!(super::count_tag(10_000), "10k");
        assert_eq!(super::count_tag(10_000_000), "10M");
        let mut v = vec![3.0, 1.0, 2.0];
        assert_eq!(super::pct(&mut v, 0.5), 2.0);
        assert_eq!(super::pct(&mut v, 0.99), 3.0);
    }
}
