//! The layer order docs/ARCHITECTURE.md states ("Layers"), held against the
//! code: every `crate::` and `super::` path in the library's non-test code
//! is an import of one file by another; an import of a module of the same
//! or a higher layer, or a cycle of files, fails this test with the path
//! that makes it. (A file's use of its own folder's `mod.rs` is how a
//! module's parts share its types, and is not an import here.)
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Module name → layer, from the table under "## Layers".
fn layers() -> BTreeMap<String, u32> {
    let md = std::fs::read_to_string(Path::new(ROOT).join("docs/ARCHITECTURE.md")).unwrap();
    let table = md.split("## Layers").nth(1).expect("docs/ARCHITECTURE.md has a \"## Layers\" section");
    let mut out = BTreeMap::new();
    for line in table.lines().skip_while(|l| !l.starts_with("| layer")).skip(2) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let layer: u32 = cells[1].parse().unwrap_or_else(|_| panic!("not a layer number: {line}"));
        for m in cells[2].split(',') {
            out.insert(m.trim().trim_matches('`').to_owned(), layer);
        }
    }
    assert!(!out.is_empty(), "the Layers table is empty");
    out
}

/// Every library source file (not the binaries, not test-only files), by
/// module path (`src/a/b.rs` and `src/a/b/mod.rs` are `a::b`).
fn files() -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![Path::new(ROOT).join("src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if name != "bin" && name != "tests" {
                    stack.push(p);
                }
                continue;
            }
            let test_only = name == "tests.rs" || name.ends_with("_tests.rs");
            if !name.ends_with(".rs") || test_only || name == "main.rs" {
                continue;
            }
            let rel = p.strip_prefix(Path::new(ROOT).join("src")).unwrap().with_extension("");
            let mut m: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if m.last().is_some_and(|l| l == "mod" || l == "lib") {
                m.pop();
            }
            out.insert(m, p);
        }
    }
    out
}

/// The code of a file without comments, string literals and its unit tests.
fn code(p: &Path) -> String {
    let text = std::fs::read_to_string(p).unwrap();
    strip(text.split("#[cfg(test)]\nmod ").next().unwrap())
}

/// Rust source without its comments and the contents of its string and
/// character literals.
fn strip(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '"' => {
                let mut escaped = false;
                for c in chars.by_ref() {
                    if c == '"' && !escaped {
                        break;
                    }
                    escaped = c == '\\' && !escaped;
                }
                out.push_str("\"\"");
            }
            // A character literal ('"', '\'', '\n'); a lifetime stays.
            '\'' => {
                let ahead: Vec<char> = chars.clone().take(12).collect();
                let close = match ahead.first() {
                    Some('\\') => ahead.iter().skip(2).position(|&c| c == '\'').map(|i| i + 2),
                    Some(_) if ahead.get(1) == Some(&'\'') => Some(1),
                    _ => None,
                };
                if let Some(n) = close {
                    for _ in 0..=n {
                        chars.next();
                    }
                    out.push_str("' '");
                } else {
                    out.push(c);
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// The paths a file names: `crate::a::b` and `super::a`, use-trees
/// (`crate::{a, b::c}`) expanded, each as the module path it starts from
/// plus the names after it.
fn paths(code: &str, me: &[String]) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = vec![];
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
        let start = if rest.starts_with("crate::") {
            Some((vec![], 7))
        } else if rest.starts_with("super::") && (i == 0 || !ident(bytes[i - 1])) {
            // `a/b.rs` and `a/b/mod.rs` are both `a::b`: `super` is `a`.
            Some((me[..me.len().saturating_sub(1)].to_vec(), 7))
        } else {
            None
        };
        let Some((base, skip)) = start else {
            i += 1;
            continue;
        };
        if i > 0 && (ident(bytes[i - 1]) || bytes[i - 1] == ':') && rest.starts_with("crate::") {
            i += 1;
            continue;
        }
        let (trees, end) = use_tree(&bytes, i + skip);
        for t in trees {
            let mut p = base.clone();
            p.extend(t);
            out.push(p);
        }
        i = end.max(i + 1);
    }
    out
}

/// The paths of a use-tree starting at `i` (`a::b`, `a::{b, c::d}`), and
/// where it ends.
fn use_tree(s: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut prefix = vec![];
    loop {
        while i < s.len() && s[i].is_whitespace() {
            i += 1;
        }
        if i < s.len() && s[i] == '{' {
            let mut out = vec![];
            i += 1;
            loop {
                while i < s.len() && (s[i].is_whitespace() || s[i] == ',') {
                    i += 1;
                }
                if i >= s.len() || s[i] == '}' {
                    return (out, i + 1);
                }
                let (sub, end) = use_tree(s, i);
                for t in sub {
                    let mut p = prefix.clone();
                    p.extend(t);
                    out.push(p);
                }
                // Something that is no path (`*`, `as x`): step over it.
                i = end.max(i + 1);
            }
        }
        let begin = i;
        while i < s.len() && ident(s[i]) {
            i += 1;
        }
        if i == begin {
            return (vec![prefix], i);
        }
        prefix.push(s[begin..i].iter().collect());
        if i + 1 < s.len() && s[i] == ':' && s[i + 1] == ':' {
            i += 2;
        } else {
            return (vec![prefix], i);
        }
    }
}

/// The file a path leads into: the longest module path that is a file.
fn resolve(path: &[String], files: &BTreeMap<Vec<String>, PathBuf>) -> Option<Vec<String>> {
    (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|m| files.contains_key(m))
}

#[test]
fn imports_follow_the_layer_table_and_no_files_import_each_other_in_a_loop() {
    let layers = layers();
    let files = files();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut wrong = vec![];
    for (me, p) in &files {
        let top = me.first().cloned().unwrap_or_default();
        for path in paths(&code(p), me) {
            let Some(first) = path.first() else { continue };
            let (Some(&from), Some(&to)) = (layers.get(&top), layers.get(first.as_str())) else {
                if !top.is_empty() && !layers.contains_key(first.as_str()) && files.contains_key(&vec![first.clone()]) {
                    wrong.push(format!("{}: module `{first}` is not in the Layers table", p.display()));
                }
                if !top.is_empty() && !layers.contains_key(&top) {
                    wrong.push(format!("module `{top}` is not in the Layers table"));
                }
                continue;
            };
            if *first != top && from <= to {
                wrong.push(format!(
                    "{} (layer {from}) imports {} (layer {to}): only lower layers may be imported",
                    p.display(),
                    path.join("::")
                ));
            }
            let Some(target) = resolve(&path, &files) else { continue };
            // A file's own folder (its `mod.rs` files above it) is not an import.
            if target == *me || me.starts_with(&target) {
                continue;
            }
            edges.entry(me.clone()).or_default().insert(target);
        }
    }
    wrong.sort();
    wrong.dedup();
    assert!(wrong.is_empty(), "imports against docs/ARCHITECTURE.md's Layers:\n{}", wrong.join("\n"));
    if let Some(cycle) = find_cycle(&edges) {
        let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
        panic!("files that import each other in a loop: {}", names.join(" -> "));
    }
}

/// A cycle of the graph, if any (depth-first, colouring).
fn find_cycle(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    #[derive(Clone, Copy, PartialEq)]
    enum C {
        White,
        Grey,
        Black,
    }
    fn visit(
        n: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        colour: &mut BTreeMap<Vec<String>, C>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        colour.insert(n.clone(), C::Grey);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            match colour.get(m).copied().unwrap_or(C::White) {
                C::Grey => {
                    let at = stack.iter().position(|x| x == m).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                C::White => {
                    if let Some(c) = visit(m, edges, colour, stack) {
                        return Some(c);
                    }
                }
                C::Black => {}
            }
        }
        stack.pop();
        colour.insert(n.clone(), C::Black);
        None
    }
    let mut colour = BTreeMap::new();
    for n in edges.keys() {
        if colour.get(n).copied().unwrap_or(C::White) == C::White {
            if let Some(c) = visit(n, edges, &mut colour, &mut vec![]) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn comments_strings_and_character_literals_are_not_code() {
    let c =
        "let a = '\\''; // std::arch\nlet b = \"asm!\"; let q = '\"'; fn f<'a>(x: &'a u8) {}\nlet u = '\\u{1F600}';";
    assert_eq!(strip(c), "let a = ' '; \nlet b = \"\"; let q = ' '; fn f<'a>(x: &'a u8) {}\nlet u = ' ';");
}

#[test]
fn the_use_tree_reader_finds_grouped_and_nested_paths() {
    let c = "use crate::{a::b, c::{d, e::F}};\nlet x = super::g::h(crate::i);";
    let me = vec!["m".to_owned(), "n".to_owned()];
    let got: Vec<String> = paths(c, &me).iter().map(|p| p.join("::")).collect();
    assert_eq!(got, ["a::b", "c::d", "c::e::F", "m::g::h", "i"]);
}

/// Every Rust file under `dir`, build outputs left out.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// docs/ARCHITECTURE.md's module table is true to the tree, file by file:
/// every file under `src/` is named in it, a top-level file in the first
/// cell of a row, a file of a folder `d/` by its path inside the folder in
/// the row whose first cell names `d/`.
#[test]
fn the_module_table_names_every_source_file() {
    let md = std::fs::read_to_string(Path::new(ROOT).join("docs/ARCHITECTURE.md")).unwrap();
    let rows: Vec<(&str, &str)> = md
        .lines()
        .skip_while(|l| !l.starts_with("| module |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| (l.split('|').nth(1).unwrap_or(""), l))
        .collect();
    assert!(!rows.is_empty(), "docs/ARCHITECTURE.md has no \"| module |\" table");
    // `name` stands in `text` as a name of its own: not the tail of a
    // longer name or path.
    let names = |text: &str, name: &str| {
        text.match_indices(name).any(|(i, _)| {
            let before = text[..i].chars().next_back();
            let after = text[i + name.len()..].chars().next();
            !before.is_some_and(|c| c.is_alphanumeric() || "_/.".contains(c))
                && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    };
    let src = Path::new(ROOT).join("src");
    let mut missing = vec![];
    for p in rust_files(&src) {
        let rel = p.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        let named = match rel.split_once('/') {
            None => rows.iter().any(|(first, _)| names(first, &rel)),
            Some((dir, rest)) => {
                let folder = format!("`{dir}/`");
                rows.iter().any(|(first, row)| first.contains(&folder) && names(row, rest))
            }
        };
        if !named {
            missing.push(format!("src/{rel}"));
        }
    }
    assert!(missing.is_empty(), "files docs/ARCHITECTURE.md's module table does not name:\n{}", missing.join("\n"));
}

/// Every CPU-specific line of the workspace is in `src/cpu.rs`: no other
/// Rust file names an architecture, its intrinsics or inline assembly.
#[test]
fn cpu_specific_code_is_in_one_module() {
    const MARKS: [&str; 8] =
        ["target_arch", "std::arch", "core::arch", "asm!", "is_x86_feature_detected", "_mm_", "_mm256_", "__cpuid"];
    let cpu = Path::new(ROOT).join("src/cpu.rs");
    let mut wrong = vec![];
    for dir in ["src", "crates", "benches", "tests", "build.rs"] {
        let dir = Path::new(ROOT).join(dir);
        let files = if dir.is_file() { vec![dir] } else { rust_files(&dir) };
        for p in files.into_iter().filter(|p| *p != cpu) {
            let code = strip(&std::fs::read_to_string(&p).unwrap());
            for m in MARKS.iter().filter(|m| code.contains(*m)) {
                wrong.push(format!("{}: `{m}`", p.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "CPU-specific code outside src/cpu.rs:\n{}", wrong.join("\n"));
}
