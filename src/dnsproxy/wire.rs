//! DNS messages through hickory-proto: no hand-written wire parsing.

use std::net::IpAddr;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::{Name, RData};

/// The question of a query: its id, name (as asked) and type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub id: u16,
    pub name: String,
    pub qtype: String,
}

/// Reads a query; `None` for anything that is not a query with exactly one question (what
/// every resolver sends; the proxy answers others with FORMERR through [`formerr`]).
pub fn question(bytes: &[u8]) -> Option<Question> {
    let m = Message::from_vec(bytes).ok()?;
    if m.message_type() != MessageType::Query || m.queries().len() != 1 {
        return None;
    }
    let q = &m.queries()[0];
    Some(Question {
        id: m.id(),
        name: presentation(q.name()),
        qtype: q.query_type().to_string(),
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
