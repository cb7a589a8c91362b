//! DNS messages through hickory-proto: no hand-written wire parsing.

use std::net::IpAddr;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::{Name, RData};

/// The question of a query: its id, name (as asked) and type, and the query to forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub id: u16,
    pub name: String,
    pub qtype: String,
    /// What is sent to the server: the query rebuilt from what was read and judged, never the
    /// bytes as they came (see [`question`]).
    pub forward: Vec<u8>,
}

/// Reads a query; `None` for anything the proxy answers with FORMERR ([`formerr`]): no query,
/// not exactly one question, or records in it.
///
/// The query forwarded is rebuilt from what was read, so the server gets exactly what was
/// judged. A stub resolver (glibc, musl, Go, systemd-resolved, CoreDNS forwarding) sends a
/// header, one question and at most an EDNS OPT record in the additional section; the rebuild
/// keeps all of it as it was (payload size, flags, options such as cookies and padding), so
/// such a query goes out byte for byte as it came. A query with anything else is refused, not
/// trimmed: answer or authority records and other additional records (TSIG, SIG(0), ...) were
/// not judged, and dropping them would change what is asked (a signed query would fail its
/// check anyway).
/// Bytes after the message are no part of it (a message ends where its counts say): they are
/// not forwarded, and the message is answered as usual.
pub fn question(bytes: &[u8]) -> Option<Question> {
    let m = Message::from_vec(bytes).ok()?;
    if m.message_type() != MessageType::Query
        || m.queries().len() != 1
        || !m.answers().is_empty()
        || !m.name_servers().is_empty()
        || !m.additionals().is_empty()
        || !m.signature().is_empty()
    {
        return None;
    }
    let q = &m.queries()[0];
    Some(Question {
        id: m.id(),
        name: presentation(q.name()),
        qtype: q.query_type().to_string(),
        forward: m.to_vec().ok()?,
    })
}

/// `name` in presentation format (RFC 1035 section 5.1) as Cilium's proxy reads it (miekg/dns):
/// printable ASCII as it is, `.`, `\`, space and `'@;()"` within a label escaped with `\`,
/// any other byte as `\DDD` (decimal). Policy matching relies on it: a `.` only ever separates
/// labels, and a byte a `*` must not match never reads as a label character. (hickory's
/// `to_ascii` also escapes a label's leading `-`, so `*.example.com` would not match
/// `-a.example.com`, which Cilium allows.)
pub fn presentation(name: &Name) -> String {
    let mut out = String::with_capacity(name.len() + 1);
    for label in name.iter() {
        for &b in label {
            match b {
                b'.' | b' ' | b'\'' | b'@' | b';' | b'(' | b')' | b'"' | b'\\' => {
                    out.push('\\');
                    out.push(char::from(b));
                }
                0x21..=0x7e => out.push(char::from(b)),
                _ => out.push_str(&format!("\\{b:03}")),
            }
        }
        out.push('.');
    }
    if out.is_empty() {
        out.push('.');
    } else if !name.is_fqdn() {
        out.pop();
    }
    out
}

fn answer_to(bytes: &[u8], code: ResponseCode) -> Option<Vec<u8>> {
    let q = Message::from_vec(bytes).ok()?;
    let mut r = Message::new();
    r.set_id(q.id())
        .set_message_type(MessageType::Response)
        .set_op_code(q.op_code())
        .set_recursion_desired(q.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code)
        .add_queries(q.queries().to_vec());
    r.to_vec().ok()
}

/// The REFUSED answer to a query (Cilium's default reject response): same id and question.
pub fn refused(query: &[u8]) -> Option<Vec<u8>> {
    answer_to(query, ResponseCode::Refused)
}

/// A FORMERR answer to a message that is no single-question query (when its id is readable).
pub fn formerr(query: &[u8]) -> Option<Vec<u8>> {
    answer_to(query, ResponseCode::FormErr)
}

/// The A and AAAA addresses of an answer, with the smallest TTL among them; `None` when the
/// message is unreadable or not a response to `id`.
pub fn addresses(answer: &[u8], id: u16) -> Option<(Vec<IpAddr>, u32)> {
    let m = Message::from_vec(answer).ok()?;
    if m.id() != id || m.message_type() != MessageType::Response {
        return None;
    }
    let mut ips = Vec::new();
    let mut ttl = u32::MAX;
    for r in m.answers() {
        let ip = match r.data() {
            RData::A(a) => IpAddr::V4(a.0),
            RData::AAAA(a) => IpAddr::V6(a.0),
            _ => continue,
        };
        ttl = ttl.min(r.ttl());
        if !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    let ttl = if ips.is_empty() { 0 } else { ttl };
    Some((ips, ttl))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::{rdata, Name, Record, RecordType};
    use std::str::FromStr;

    pub(crate) fn query(id: u16, name: &str) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(id)
            .set_message_type(MessageType::Query)
            .set_recursion_desired(true)
            .add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
        m.to_vec().unwrap()
    }

    pub(crate) fn answer(query: &[u8], ips: &[&str], ttl: u32) -> Vec<u8> {
        let q = Message::from_vec(query).unwrap();
        let mut m = Message::new();
        m.set_id(q.id())
            .set_message_type(MessageType::Response)
            .add_queries(q.queries().to_vec());
        let name = q.queries()[0].name().clone();
        for ip in ips {
            let a: std::net::Ipv4Addr = ip.parse().unwrap();
            m.add_answer(Record::from_rdata(name.clone(), ttl, RData::A(rdata::A(a))));
        }
        m.to_vec().unwrap()
    }

    #[test]
    fn names_read_as_cilium_reads_them() {
        use hickory_proto::rr::domain::Label;
        let raw = |labels: &[&[u8]]| {
            presentation(
                &Name::from_labels(labels.iter().map(|l| Label::from_raw_bytes(l).unwrap()))
                    .unwrap(),
            )
        };
        assert_eq!(raw(&[b"-a", b"Api_1", b"com"]), "-a.Api_1.com.");
        assert_eq!(raw(&[b"a.b", b"x y", b"\\"]), "a\\.b.x\\ y.\\\\.");
        assert_eq!(
            raw(&[b"\0\xff\xfe\x80", b"*", b"a*"]),
            "\\000\\255\\254\\128.*.a*."
        );
        assert_eq!(presentation(&Name::root()), ".");
        assert_eq!(presentation(&Name::from_ascii("a.b").unwrap()), "a.b");
    }

    fn a(owner: &str, ip: &str, ttl: u32) -> Record {
        let ip: std::net::Ipv4Addr = ip.parse().unwrap();
        Record::from_rdata(
            Name::from_ascii(owner).unwrap(),
            ttl,
            RData::A(rdata::A(ip)),
        )
    }

    #[test]
    fn only_what_was_judged_is_forwarded() {
        // A resolver's query: mixed case (0x20), EDNS with a cookie option.
        let mut m = Message::new();
        m.set_id(77)
            .set_message_type(MessageType::Query)
            .set_recursion_desired(true)
            .add_query(Query::query(
                Name::from_ascii("ApI.ExAmple.CoM.").unwrap(),
                RecordType::AAAA,
            ));
        let mut edns = hickory_proto::op::Edns::new();
        edns.set_max_payload(1232);
        edns.options_mut()
            .insert(hickory_proto::rr::rdata::opt::EdnsOption::Unknown(
                10,
                vec![1, 2, 3, 4, 5, 6, 7, 8],
            ));
        m.set_edns(edns);
        let clean = m.to_vec().unwrap();
        let q = question(&clean).unwrap();
        assert_eq!(q.name, "ApI.ExAmple.CoM.");
        assert_eq!(q.forward, clean, "a resolver's query goes out as it came");

        // Bytes after the message (here a second question for another name) are not forwarded.
        let mut smuggled = clean.clone();
        smuggled.extend_from_slice(&super::tests::query(1, "evil.test.")[12..]);
        smuggled.extend_from_slice(b"\xff\x00garbage");
        let s = question(&smuggled).unwrap();
        assert_eq!(s.name, q.name);
        assert_eq!(s.forward, clean, "the upstream sees no trailing bytes");
        let parsed = Message::from_vec(&s.forward).unwrap();
        assert_eq!(parsed.queries().len(), 1);
        assert_eq!(
            parsed.extensions().as_ref().map(|e| e.max_payload()),
            Some(1232)
        );

        // Records a query has no business carrying were never judged: FORMERR, not forwarded.
        let mut answer = Message::from_vec(&clean).unwrap();
        answer.add_answer(a("evil.test.", "6.6.6.6", 300));
        let mut authority = Message::from_vec(&clean).unwrap();
        authority.add_name_server(a("evil.test.", "6.6.6.6", 300));
        let mut additional = Message::from_vec(&clean).unwrap();
        additional.add_additional(a("evil.test.", "6.6.6.6", 300));
        for (what, m) in [
            ("answer", answer),
            ("authority", authority),
            ("additional", additional),
        ] {
            let bytes = m.to_vec().unwrap();
            assert!(question(&bytes).is_none(), "a query with an {what} record");
            let f = Message::from_vec(&formerr(&bytes).unwrap()).unwrap();
            assert_eq!((f.id(), f.response_code()), (77, ResponseCode::FormErr));
        }
    }

    #[test]
    fn questions_refusals_and_answer_addresses_round_trip() {
        let q = query(4242, "API.Example.com.");
        let got = question(&q).unwrap();
        assert_eq!(
            (got.id, got.name.as_str(), got.qtype.as_str()),
            (4242, "api.example.com.", "A"),
            "hickory reads names in lower case; policy matching normalizes anyway"
        );
        let r = Message::from_vec(&refused(&q).unwrap()).unwrap();
        assert_eq!(r.id(), 4242);
        assert_eq!(r.response_code(), ResponseCode::Refused);
        assert_eq!(r.queries().len(), 1);
        let a = answer(&q, &["192.0.2.1", "192.0.2.2"], 30);
        let (ips, ttl) = addresses(&a, 4242).unwrap();
        assert_eq!(ips.len(), 2);
        assert_eq!(ttl, 30);
        assert!(
            addresses(&a, 1).is_none(),
            "an answer to another id is no answer"
        );
        assert!(question(&a).is_none(), "a response is no query");
        assert!(question(b"\x00\x01garbage").is_none());
    }
}
