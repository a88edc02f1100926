//! The `cxlkv-trace` binary as the docs run it: a generated trace written to
//! a file, then replayed as a table, as JSON with an SVG chart, and with a
//! config's policies, and its fluid estimate.
use std::process::{Command, Output};

fn trace_tool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cxlkv-trace")).args(args).output().expect("cxlkv-trace runs")
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "exit {:?}: {}", o.status, String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn gen_trace_then_replay_as_table_json_svg_and_with_a_config() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("chat.jsonl");
    let t = trace.to_str().unwrap();
    stdout(&trace_tool(&["gen-trace", "--shape", "chat", "--requests", "400", "--seed", "7", "--out", t]));
    let text = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(text.lines().count(), 400);
    // The same shape and seed on stdout: the same trace.
    assert_eq!(stdout(&trace_tool(&["gen-trace", "--shape", "chat", "--requests", "400", "--seed", "7"])), text);

    let table = stdout(&trace_tool(&["replay", t, "--policy", "lru,default,belady", "--capacity", "0.05"]));
    assert!(table.contains("belady") && table.contains("5.0%"), "{table}");

    let svg = dir.path().join("chat.svg");
    let json = stdout(&trace_tool(&[
        "replay",
        t,
        "--policy",
        "lru,gd",
        "--capacity",
        "0.01,0.05",
        "--json",
        "--svg",
        svg.to_str().unwrap(),
    ]));
    let cells: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(cells.as_array().unwrap().len(), 4);
    assert_eq!(std::fs::read_to_string(&svg).unwrap().matches("<polyline").count(), 2);

    // `default` is the config's policy.
    let cfg = dir.path().join("cxlkv.toml");
    std::fs::write(&cfg, "[registry]\neviction_policy = \"lru\"\n").unwrap();
    let block_hit = |policy: &str, more: &[&str]| {
        let mut args = vec!["replay", t, "--policy", policy, "--capacity", "0.05", "--json"];
        args.extend(more);
        let cells: serde_json::Value = serde_json::from_str(&stdout(&trace_tool(&args))).unwrap();
        cells[0]["block_hit"].as_f64().unwrap()
    };
    assert_eq!(block_hit("default", &["--config", cfg.to_str().unwrap()]), block_hit("lru", &[]));

    let line = stdout(&trace_tool(&["fluid-bound", t, "--classes", "count"]));
    let (head, hits) = line.trim_end().split_once(" classes: ").unwrap();
    assert_eq!(head, format!("{t} count 5"));
    assert_eq!(hits.split(' ').filter(|h| h.parse::<f64>().is_ok()).count(), 4, "{line}");
}

#[test]
fn bad_input_exits_2_with_a_message() {
    let o = trace_tool(&["gen-trace", "--shape", "video", "--requests", "5"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown shape \"video\""));
    let o = trace_tool(&["replay", "/nonexistent/trace.jsonl"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("cxlkv-trace replay: "));
}
