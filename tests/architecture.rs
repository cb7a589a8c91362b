//! The module graph of `src/` stays acyclic: every `crate::X` a top-level module's files name is
//! an edge to `X`, and no path of edges may come back. `agent` (with `agent/run.rs`) is the only
//! composition root; the shared runtime services (`runtime`, `introspect`, `metrics`), the
//! settings types (`config`) and the endpoint state (`endpoint`) are below everything that uses
//! them. A new back edge fails here, naming the cycle and a file for each edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read src").flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level modules `lib.rs` declares.
fn top_level(src: &Path) -> BTreeSet<String> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    lib.lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';').to_string())
        .collect()
}

/// Every `crate::name` (and `$crate::name`, and `name` inside `use crate::{...}`) in `text`.
fn referenced(text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for part in inner.split(',') {
                out.insert(ident(part.trim()));
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|m| modules.contains(m));
    out
}

/// The module graph: module -> (module it names -> one file that does).
fn graph(src: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    let modules = top_level(src);
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut g: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).expect("under src");
        let first = rel.components().next().expect("a component");
        let top = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if !modules.contains(&top) {
            continue; // lib.rs, main.rs: the roots
        }
        let text = std::fs::read_to_string(&f).expect("a source file");
        for to in referenced(&text, &modules) {
            if to != top {
                g.entry(top.clone())
                    .or_default()
                    .entry(to)
                    .or_insert_with(|| rel.display().to_string());
            }
        }
    }
    g
}

/// A cycle through `start`, if any (depth-first search).
fn cycle_from(g: &BTreeMap<String, BTreeMap<String, String>>, start: &str) -> Option<Vec<String>> {
    fn dfs(
        g: &BTreeMap<String, BTreeMap<String, String>>,
        at: &str,
        start: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in g.get(at).into_iter().flat_map(|e| e.keys()) {
            if next == start {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if dfs(g, next, start, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_string()];
    let mut seen = BTreeSet::new();
    dfs(g, start, start, &mut path, &mut seen).then_some(path)
}

#[test]
fn top_level_modules_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = graph(&src);
    assert!(g.len() > 10, "the graph was read: {g:?}");
    for start in g.keys() {
        if let Some(cycle) = cycle_from(&g, start) {
            let mut why = Vec::new();
            for (i, m) in cycle.iter().enumerate() {
                let next = &cycle[(i + 1) % cycle.len()];
                why.push(format!("{m} -> {next} ({})", g[m][next]));
            }
            panic!("module cycle: {}", why.join(", "));
        }
    }
}

#[test]
fn the_cycle_check_finds_a_cycle() {
    let mut g: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let edge = |g: &mut BTreeMap<String, BTreeMap<String, String>>, a: &str, b: &str| {
        g.entry(a.into())
            .or_default()
            .insert(b.into(), format!("{a}.rs"));
    };
    edge(&mut g, "a", "b");
    edge(&mut g, "b", "c");
    assert_eq!(cycle_from(&g, "a"), None);
    edge(&mut g, "c", "a");
    assert_eq!(
        cycle_from(&g, "a"),
        Some(vec!["a".into(), "b".into(), "c".into()])
    );
    let modules: BTreeSet<String> = ["agent", "policy"].iter().map(|s| s.to_string()).collect();
    assert_eq!(
        referenced(
            "use crate::{agent::run, policy};\nlet x = $crate::policy::y;",
            &modules
        ),
        modules
    );
}

#[test]
fn only_the_composition_root_names_the_agent() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = graph(&src);
    let users: Vec<String> = g
        .iter()
        .filter(|(m, e)| m.as_str() != "agent" && e.contains_key("agent"))
        .map(|(m, e)| format!("{m} ({})", e["agent"]))
        .collect();
    assert!(
        users.is_empty(),
        "modules below the agent name it: {users:?}"
    );
}

/// `(length, first line)` of every `fn handle` in `text` (the lines from its signature to its
/// closing brace).
fn handler_lengths(text: &str) -> Vec<(usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_start().starts_with("fn handle(") {
            let (start, mut depth, mut opened) = (i, 0i32, false);
            while i < lines.len() {
                depth += lines[i].matches('{').count() as i32;
                depth -= lines[i].matches('}').count() as i32;
                opened |= lines[i].contains('{');
                if opened && depth == 0 {
                    break;
                }
                i += 1;
            }
            out.push((i - start + 1, start + 1));
        }
        i += 1;
    }
    out
}

/// The text of an actor: its file, or every file of its folder (`policy_repo/`).
fn actor_text(dir: &Path, name: &str) -> String {
    let file = dir.join(format!("{name}.rs"));
    if file.is_file() {
        return std::fs::read_to_string(&file).expect("an actor file");
    }
    let mut files: Vec<_> = std::fs::read_dir(dir.join(name))
        .expect("an actor folder")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read_to_string(p).expect("an actor file"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The repository actor stays a thin layer over the pure state: no handler over 30 lines.
#[test]
fn policy_repo_handlers_stay_short() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/actors");
    let text = actor_text(&dir, "policy_repo");
    let handlers = handler_lengths(&text);
    assert!(
        handlers.len() >= 15,
        "the handlers were found: {handlers:?}"
    );
    let long: Vec<_> = handlers.iter().filter(|(n, _)| *n > 30).collect();
    assert!(
        long.is_empty(),
        "handlers over 30 lines (length, line): {long:?}"
    );
    assert_eq!(
        handler_lengths("fn handle(&mut self) {\n    if x {\n    }\n}\n"),
        [(4, 1)]
    );
}

/// The actor files import each other's messages without a cycle: an actor that must report to
/// one that drives it holds a recipient of the message (`TracedRecipient`), never its type.
#[test]
fn actor_files_form_no_cycle() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/actors");
    let names: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("src/actors")
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            match n.strip_suffix(".rs") {
                Some(stem) => Some(stem.to_string()),
                None => e.path().is_dir().then_some(n),
            }
        })
        .filter(|n| n != "mod")
        .collect();
    let mut g: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for from in &names {
        let text = actor_text(&dir, from);
        for to in &names {
            let named = [format!("super::{to}::"), format!("actors::{to}::")]
                .iter()
                .any(|p| text.contains(p.as_str()));
            if to != from && named {
                g.entry(from.clone())
                    .or_default()
                    .insert(to.clone(), format!("{from}.rs"));
            }
        }
    }
    assert!(
        g.get("policy_repo")
            .is_some_and(|e| e.contains_key("endpoint")),
        "the graph was read: {g:?}"
    );
    for start in g.keys() {
        assert_eq!(cycle_from(&g, start), None, "actor files import each other");
    }
}
