//! A hand-written SVG line chart of replay results: block-hit ratio against
//! capacity (log scale), one line per policy. No plotting dependency: the
//! chart is a few dozen elements.
use std::fmt::Write;

use crate::Cell;

const W: f64 = 720.0;
const H: f64 = 440.0;
/// Margins: left, right (legend), top, bottom.
const L: f64 = 64.0;
const R: f64 = 150.0;
const T: f64 = 36.0;
const B: f64 = 48.0;
const COLORS: &[&str] =
    &["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"];

pub fn chart(title: &str, cells: &[Cell]) -> String {
    let mut policies: Vec<&str> = vec![];
    for c in cells {
        if !policies.contains(&c.policy.as_str()) {
            policies.push(&c.policy);
        }
    }
    let (cmin, cmax) = cells.iter().fold((f64::MAX, f64::MIN), |(a, b), c| (a.min(c.capacity), b.max(c.capacity)));
    let (cmin, cmax) = if cmin < cmax { (cmin, cmax) } else { (cmin / 2.0, cmin * 2.0) };
    let ymax = cells.iter().map(|c| c.block_hit).fold(0.0, f64::max);
    let ymax = ((ymax * 10.0).ceil() / 10.0).max(0.1);
    let x = |c: f64| L + (c.ln() - cmin.ln()) / (cmax.ln() - cmin.ln()) * (W - L - R);
    let y = |v: f64| H - B - v / ymax * (H - T - B);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>"#,
        (W - R + L) / 2.0,
        esc(title)
    );
    // Axes, grid and ticks.
    for i in 0..=5 {
        let v = ymax * i as f64 / 5.0;
        let yy = y(v);
        let _ = writeln!(s, r##"<line x1="{L}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/>"##, W - R);
        let _ = writeln!(s, r#"<text x="{}" y="{:.1}" text-anchor="end">{:.0}%</text>"#, L - 6.0, yy + 4.0, v * 100.0);
    }
    let mut caps: Vec<f64> = cells.iter().map(|c| c.capacity).collect();
    caps.sort_by(|a, b| a.partial_cmp(b).unwrap());
    caps.dedup();
    for &c in &caps {
        let xx = x(c);
        let _ = writeln!(s, r##"<line x1="{xx:.1}" y1="{T}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/>"##, H - B);
        let _ = writeln!(s, r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}%</text>"#, H - B + 16.0, fmt_pct(c));
    }
    let _ = writeln!(s, r#"<line x1="{L}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#, H - B, W - R, H - B);
    let _ = writeln!(s, r#"<line x1="{L}" y1="{T}" x2="{L}" y2="{:.1}" stroke="black"/>"#, H - B);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">capacity (share of unique blocks, log scale)</text>"#,
        (W - R + L) / 2.0,
        H - 10.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(16 {}) rotate(-90)" text-anchor="middle">block hit ratio</text>"#,
        (H - B + T) / 2.0
    );
    for (i, p) in policies.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut pts: Vec<&Cell> = cells.iter().filter(|c| c.policy == *p).collect();
        pts.sort_by(|a, b| a.capacity.partial_cmp(&b.capacity).unwrap());
        let path: Vec<String> = pts.iter().map(|c| format!("{:.1},{:.1}", x(c.capacity), y(c.block_hit))).collect();
        let dash = if p.eq_ignore_ascii_case("belady") { r#" stroke-dasharray="6 4""# } else { "" };
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
            path.join(" ")
        );
        for c in &pts {
            let _ =
                writeln!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#, x(c.capacity), y(c.block_hit));
        }
        let ly = T + 10.0 + i as f64 * 20.0;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>"#,
            W - R + 12.0,
            W - R + 36.0
        );
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}</text>"#, W - R + 42.0, ly + 4.0, esc(p));
    }
    s + "</svg>\n"
}

fn fmt_pct(c: f64) -> String {
    let v = c * 100.0;
    if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
