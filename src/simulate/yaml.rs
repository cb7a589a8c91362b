//! Streaming access to a large world file.
//!
//! serde_yaml collects every event of a document before it deserialises anything (a 200 MB world
//! held ~30 bytes of events per byte of text), so the world is never handed to it whole. Instead
//! libyaml's event parser (the one serde_yaml runs on, so both read the text the same way) walks
//! the document once and records the byte span of each entry of the top-level sections
//! (`pods[i]`, `namespaces.<name>`, ...). Each entry is then deserialised on its own from its
//! span, so only one entry's events exist at a time. An anchor would therefore only be visible
//! inside the entry that defines it: a world with any alias (`*name`) is instead read whole once,
//! its aliases replaced by what they name ([`expand_aliases`], bounded), and that text walked.

use std::borrow::Cow;
use std::ffi::CStr;
use std::marker::PhantomData;
use std::mem::MaybeUninit;

use serde::de::DeserializeOwned;
use unsafe_libyaml as unsafe_sys;

use super::{werr, WorldError};
use crate::policy::labels::shorten;
use crate::policy::translate::Document;

/// A position in the text: byte offset, 0-based line, 0-based column (in characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark {
    pub index: usize,
    pub line: usize,
    pub column: usize,
}

impl Mark {
    fn from_sys(m: &unsafe_sys::yaml_mark_t) -> Mark {
        Mark {
            index: usize::try_from(m.index).unwrap_or(usize::MAX),
            line: usize::try_from(m.line).unwrap_or(usize::MAX),
            column: usize::try_from(m.column).unwrap_or(usize::MAX),
        }
    }

    /// `line L column C`, 1-based as editors count.
    pub fn describe(&self) -> String {
        format!(
            "line {} column {}",
            self.line.saturating_add(1),
            self.column.saturating_add(1)
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    StreamEnd,
    DocumentStart,
    DocumentEnd,
    Alias,
    /// A scalar; `plain_null` when it is a plain `~`, `null` or empty scalar.
    Scalar {
        value: String,
        plain_null: bool,
    },
    SequenceStart,
    SequenceEnd,
    MappingStart,
    MappingEnd,
    StreamStart,
}

struct Event {
    kind: Kind,
    start: Mark,
    end: Mark,
}

/// libyaml's pull parser over a borrowed text.
struct Parser<'a> {
    sys: Box<MaybeUninit<unsafe_sys::yaml_parser_t>>,
    _input: PhantomData<&'a [u8]>,
    /// Where the first alias is, if one was seen.
    alias: Option<Mark>,
}

impl<'a> Parser<'a> {
    fn new(input: &'a str) -> Result<Parser<'a>, WorldError> {
        let mut sys = Box::new(MaybeUninit::<unsafe_sys::yaml_parser_t>::uninit());
        // SAFETY: `yaml_parser_initialize` initialises the boxed struct in place (its address is
        // stable); the input it reads from is borrowed for 'a, which the parser cannot outlive.
        unsafe {
            let p = sys.as_mut_ptr();
            if unsafe_sys::yaml_parser_initialize(p).fail {
                return Err(werr("(document)", "cannot initialise the YAML parser"));
            }
            unsafe_sys::yaml_parser_set_encoding(p, unsafe_sys::YAML_UTF8_ENCODING);
            unsafe_sys::yaml_parser_set_input_string(p, input.as_ptr(), input.len() as u64);
        }
        Ok(Parser {
            sys,
            _input: PhantomData,
            alias: None,
        })
    }

    /// The next event; `want_value` copies a scalar's value (only keys need it).
    fn next(&mut self, want_value: bool) -> Result<Event, WorldError> {
        let mut ev = MaybeUninit::<unsafe_sys::yaml_event_t>::uninit();
        // SAFETY: the parser was initialised in `new`; an event filled by a successful
        // `yaml_parser_parse` is read once and then released with `yaml_event_delete`.
        unsafe {
            if self.sys.assume_init_ref().error != unsafe_sys::YAML_NO_ERROR
                || unsafe_sys::yaml_parser_parse(self.sys.as_mut_ptr(), ev.as_mut_ptr()).fail
            {
                return Err(parse_error(self.sys.assume_init_ref()));
            }
            let e = &*ev.as_ptr();
            let kind = match e.type_ {
                unsafe_sys::YAML_STREAM_START_EVENT => Kind::StreamStart,
                unsafe_sys::YAML_STREAM_END_EVENT => Kind::StreamEnd,
                unsafe_sys::YAML_DOCUMENT_START_EVENT => Kind::DocumentStart,
                unsafe_sys::YAML_DOCUMENT_END_EVENT => Kind::DocumentEnd,
                unsafe_sys::YAML_ALIAS_EVENT => Kind::Alias,
                unsafe_sys::YAML_SEQUENCE_START_EVENT => Kind::SequenceStart,
                unsafe_sys::YAML_SEQUENCE_END_EVENT => Kind::SequenceEnd,
                unsafe_sys::YAML_MAPPING_START_EVENT => Kind::MappingStart,
                unsafe_sys::YAML_MAPPING_END_EVENT => Kind::MappingEnd,
                _ => {
                    let s = &e.data.scalar;
                    let bytes: &[u8] = if s.value.is_null() {
                        &[]
                    } else {
                        std::slice::from_raw_parts(s.value, s.length as usize)
                    };
                    let plain = s.style == unsafe_sys::YAML_PLAIN_SCALAR_STYLE;
                    let plain_null = plain
                        && s.tag.is_null()
                        && matches!(bytes, b"" | b"~" | b"null" | b"Null" | b"NULL");
                    let value = if want_value {
                        String::from_utf8_lossy(bytes).into_owned()
                    } else {
                        String::new()
                    };
                    Kind::Scalar { value, plain_null }
                }
            };
            let out = Event {
                kind,
                start: Mark::from_sys(&e.start_mark),
                end: Mark::from_sys(&e.end_mark),
            };
            unsafe_sys::yaml_event_delete(ev.as_mut_ptr());
            if out.kind == Kind::Alias && self.alias.is_none() {
                self.alias = Some(out.start);
            }
            Ok(out)
        }
    }
}

impl Drop for Parser<'_> {
    fn drop(&mut self) {
        // SAFETY: initialised in `new` (a failed initialisation never builds a `Parser`).
        unsafe { unsafe_sys::yaml_parser_delete(self.sys.as_mut_ptr()) }
    }
}

/// A syntax error as libyaml reports it, with its position.
fn parse_error(p: &unsafe_sys::yaml_parser_t) -> WorldError {
    let text = |c: *const std::os::raw::c_char| {
        if c.is_null() {
            None
        } else {
            // SAFETY: libyaml's problem and context are static NUL-terminated strings.
            Some(unsafe { CStr::from_ptr(c) }.to_string_lossy().into_owned())
        }
    };
    let problem = text(p.problem).unwrap_or_else(|| "malformed YAML".into());
    let mark = Mark::from_sys(&p.problem_mark);
    let message = match text(p.context) {
        Some(ctx) => format!(
            "{problem}, {ctx} at {}",
            Mark::from_sys(&p.context_mark).describe()
        ),
        None => problem,
    };
    werr(format!("(document) {}", mark.describe()), message)
}

/// Where an entry (or a whole section value) stands in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: Mark,
    pub end: usize,
}

/// One top-level key of the world.
#[derive(Debug)]
pub(crate) struct Section {
    pub value: Span,
    /// The entries one by one: sequence items, or `key: value` pairs of a mapping (when the
    /// value has the shape the section expects); `None` means parse `value` whole.
    pub entries: Option<Vec<Span>>,
}

/// The top-level sections of a world, in the order the file has them.
#[derive(Debug, Default)]
pub(crate) struct Sections {
    pub list: Vec<(String, Section)>,
    /// Where the document's first alias is: its entries cannot be read one by one.
    pub alias: Option<Mark>,
}

impl Sections {
    pub fn get(&self, key: &str) -> Option<&Section> {
        self.list.iter().find(|(k, _)| k == key).map(|(_, s)| s)
    }
}

/// The sections a world may have, and whether each holds a mapping (else a sequence).
pub(crate) const SECTIONS: [(&str, bool); 6] = [
    ("namespaces", true),
    ("dns", true),
    ("nodes", false),
    ("pods", false),
    ("policies", false),
    ("probes", false),
];

/// Walks the document once and records where every entry is. `Ok(None)`: the file holds no
/// document at all (empty, only comments, or a null document).
pub(crate) fn scan(text: &str) -> Result<Option<Sections>, WorldError> {
    let mut p = Parser::new(text)?;
    let first = p.next(false)?;
    if first.kind != Kind::StreamStart {
        return Err(werr("(document)", "not a YAML stream"));
    }
    let doc = p.next(false)?;
    if doc.kind == Kind::StreamEnd {
        return Ok(None);
    }
    let root = p.next(false)?;
    let sections = match root.kind {
        Kind::Scalar {
            plain_null: true, ..
        } => None,
        Kind::MappingStart => Some(Sections {
            list: scan_root(&mut p)?,
            alias: p.alias,
        }),
        _ => {
            return Err(werr(
                format!("(document) {}", root.start.describe()),
                "a world must be a mapping with namespaces, nodes, pods, policies and probes",
            ))
        }
    };
    let end = p.next(false)?;
    if end.kind != Kind::DocumentEnd {
        return Err(werr("(document)", "malformed document end"));
    }
    let next = p.next(false)?;
    if next.kind != Kind::StreamEnd {
        return Err(werr(
            format!("(document) {}", next.start.describe()),
            "a world file holds one YAML document, not several",
        ));
    }
    Ok(sections)
}

fn scan_root(p: &mut Parser) -> Result<Vec<(String, Section)>, WorldError> {
    let mut out: Vec<(String, Section)> = Vec::new();
    loop {
        let key = p.next(true)?;
        let name = match key.kind {
            Kind::MappingEnd => return Ok(out),
            Kind::Scalar { value, .. } => value,
            _ => {
                return Err(werr(
                    format!("(document) {}", key.start.describe()),
                    "a top-level key must be a plain name",
                ))
            }
        };
        let Some((_, mapping)) = SECTIONS.iter().find(|(n, _)| *n == name) else {
            let names: Vec<String> = SECTIONS.iter().map(|(n, _)| format!("`{n}`")).collect();
            return Err(werr(
                format!("(document) {}", key.start.describe()),
                format!(
                    "unknown field {}, expected one of {}",
                    shorten(&name),
                    names.join(", ")
                ),
            ));
        };
        if out.iter().any(|(k, _)| *k == name) {
            return Err(werr(
                format!("(document) {}", key.start.describe()),
                format!("duplicate field `{name}`"),
            ));
        }
        let first = p.next(false)?;
        let start = first.start;
        let section = match (&first.kind, mapping) {
            (Kind::SequenceStart, false) => {
                let (entries, end) = scan_entries(p, Kind::SequenceEnd, 1)?;
                Section {
                    value: Span { start, end },
                    entries: Some(entries),
                }
            }
            (Kind::MappingStart, true) => {
                let (entries, end) = scan_entries(p, Kind::MappingEnd, 2)?;
                Section {
                    value: Span { start, end },
                    entries: Some(entries),
                }
            }
            _ => Section {
                value: Span {
                    start,
                    end: skip_node(p, first)?,
                },
                entries: None,
            },
        };
        out.push((name, section));
    }
}

/// The spans of a collection's entries up to its end event; `nodes` per entry (1: a sequence
/// item, 2: a mapping's key and value). Returns the spans and the collection's end offset.
fn scan_entries(
    p: &mut Parser,
    close: Kind,
    nodes: usize,
) -> Result<(Vec<Span>, usize), WorldError> {
    let mut entries = Vec::new();
    loop {
        let first = p.next(false)?;
        if first.kind == close {
            return Ok((entries, first.end.index));
        }
        let start = first.start;
        let mut end = skip_node(p, first)?;
        for _ in 1..nodes {
            let next = p.next(false)?;
            end = skip_node(p, next)?;
        }
        entries.push(Span { start, end });
    }
}

/// Consumes the rest of the node `first` starts; returns its end offset.
fn skip_node(p: &mut Parser, first: Event) -> Result<usize, WorldError> {
    let mut depth = 0usize;
    let mut ev = first;
    loop {
        match ev.kind {
            Kind::SequenceStart | Kind::MappingStart => depth += 1,
            Kind::SequenceEnd | Kind::MappingEnd => depth = depth.saturating_sub(1),
            Kind::Scalar { .. } | Kind::Alias => {}
            _ => {
                return Err(werr(
                    format!("(document) {}", ev.start.describe()),
                    "unexpected end of the document",
                ))
            }
        }
        if depth == 0 {
            return Ok(ev.end.index);
        }
        ev = p.next(false)?;
    }
}

/// The world read whole, its aliases replaced by what they name (serde_yaml bounds how much an
/// alias may repeat), written again as YAML with no anchor left.
pub(crate) fn expand_aliases(text: &str) -> Result<String, WorldError> {
    let read = |e: serde_yaml::Error| werr("(document)", error_message(&e, "", 0));
    let Document(world) = serde_yaml::from_str(text).map_err(read)?;
    serde_yaml::to_string(&world).map_err(read)
}

/// The text of one entry, indented as in the file so that a block mapping keeps its shape.
fn entry_text<'t>(text: &'t str, span: &Span) -> Option<Cow<'t, str>> {
    let body = text.get(span.start.index..span.end)?;
    Some(if span.start.column == 0 {
        Cow::Borrowed(body)
    } else {
        let mut s = " ".repeat(span.start.column);
        s.push_str(body);
        Cow::Owned(s)
    })
}

/// Deserialises the entry at `span`; errors name `entry` and the field path inside it, with
/// the line and column in the whole file.
pub(crate) fn parse_entry<T: DeserializeOwned>(
    text: &str,
    span: &Span,
    entry: &str,
) -> Result<T, WorldError> {
    let src = entry_text(text, span)
        .ok_or_else(|| werr(entry, "the entry's position in the file is not valid text"))?;
    let de = serde_yaml::Deserializer::from_str(&src);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = error_message(&inner, &path, span.start.line);
        werr(join_path(entry, &path), message)
    })
}

/// `entry` extended by a serde path relative to it (`.` and `?` mean the entry itself).
fn join_path(entry: &str, path: &str) -> String {
    match path {
        "." | "?" | "" => entry.to_string(),
        p if p.starts_with('[') => format!("{entry}{p}"),
        p => format!("{entry}.{p}"),
    }
}

/// A serde_yaml error's message without the field path it already carries (the caller names
/// the entry and path once) and with its position counted from the top of the file.
pub(crate) fn error_message(e: &serde_yaml::Error, path: &str, line_offset: usize) -> String {
    let full = e.to_string();
    let mut msg = full.as_str();
    if let Some(rest) = msg.strip_prefix(path).and_then(|r| r.strip_prefix(": ")) {
        msg = rest;
    }
    match e.location() {
        Some(loc) => {
            let suffix = format!(" at line {} column {}", loc.line(), loc.column());
            let msg = msg.strip_suffix(&suffix).unwrap_or(msg);
            format!(
                "{msg} at line {} column {}",
                loc.line().saturating_add(line_offset),
                loc.column()
            )
        }
        None => msg.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_found_in_block_and_flow_style() {
        let text = "pods:\n  - namespace: x\n    name: a\n  - {namespace: y, name: b}\nnamespaces: {x: {a: b}, y: ~}\n";
        let s = scan(text).unwrap().unwrap();
        let pods = s.get("pods").unwrap().entries.as_ref().unwrap();
        assert_eq!(pods.len(), 2);
        let a: std::collections::BTreeMap<String, String> =
            parse_entry(text, &pods[0], "pods[0]").unwrap();
        assert_eq!(a["name"], "a");
        let ns = s.get("namespaces").unwrap().entries.as_ref().unwrap();
        assert_eq!(ns.len(), 2);
    }

    #[test]
    fn empty_and_comment_only_files_hold_no_document() {
        for text in ["", "# nothing\n", "---\n", "~\n", "\n\n"] {
            assert!(scan(text).unwrap().is_none(), "{text:?}");
        }
        assert!(scan("{}").unwrap().is_some());
    }

    #[test]
    fn entry_errors_carry_the_path_once_and_the_file_line() {
        let text = "probes:\n  - {from: a, to: b}\n  - {from: a, to: b, port: abc}\n";
        let s = scan(text).unwrap().unwrap();
        let e = &s.get("probes").unwrap().entries.as_ref().unwrap()[1];
        let err = parse_entry::<std::collections::BTreeMap<String, i64>>(text, e, "probes[1]")
            .unwrap_err();
        assert_eq!(err.entry, "probes[1].from");
        assert!(!err.message.contains("from:"), "{}", err.message);
        assert!(
            err.message.ends_with("at line 3 column 12"),
            "{}",
            err.message
        );
    }
}
