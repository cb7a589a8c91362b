//! DNS messages through hickory-proto: no hand-written wire parsing.

use std::net::IpAddr;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::{Name, RData};

/// CNAME records followed from the question's name, at most (resolvers stop at 8 to 16).
pub const MAX_CNAMES: usize = 16;

/// The question of a query: its id, name (as asked) and type, and the query to forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub id: u16,
    pub name: String,
    pub qtype: String,
    /// The name as read: where the answer's CNAME chain starts ([`addresses`]).
    pub asked: Name,
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
        asked: q.name().clone(),
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

/// The addresses an answer gives the question's name, with the smallest TTL on the way there;
/// `None` when the message is unreadable or not a response to the query's id.
///
/// As in Cilium (`ExtractMsgDetails`), only the question's name and the names its CNAME
/// records lead to count, followed in the order of the answer section (case-insensitively):
/// an A or AAAA record is learned when its owner is the name the chain has reached, a CNAME of
/// that name moves the chain on, at most [`MAX_CNAMES`] times. Records of other names teach
/// nothing (Cilium learns nothing from such an answer at all; here the chain's own records
/// still count): a server cannot have `evil.test`'s address learned under the name asked. The
/// TTL is the smallest of the records followed, CNAMEs included.
pub fn addresses(answer: &[u8], q: &Question) -> Option<(Vec<IpAddr>, u32)> {
    let m = Message::from_vec(answer).ok()?;
    if m.id() != q.id || m.message_type() != MessageType::Response {
        return None;
    }
    let mut at = &q.asked;
    let mut cnames = 0;
    let mut ips = Vec::new();
    let mut ttl = u32::MAX;
    for r in m.answers() {
        if !r.name().eq_ignore_root(at) {
            continue;
        }
        let ip = match r.data() {
            RData::A(a) => IpAddr::V4(a.0),
            RData::AAAA(a) => IpAddr::V6(a.0),
            RData::CNAME(target) if cnames < MAX_CNAMES => {
                cnames += 1;
                ttl = ttl.min(r.ttl());
                at = &target.0;
                continue;
            }
            // A chain longer than the bound: what it leads to is not learned.
            RData::CNAME(_) => break,
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

    /// A response to `query` (its id and question) carrying `records`.
    fn response(query: &[u8], records: Vec<Record>) -> Vec<u8> {
        let q = Message::from_vec(query).unwrap();
        let mut m = Message::new();
        m.set_id(q.id())
            .set_message_type(MessageType::Response)
            .add_queries(q.queries().to_vec());
        for r in records {
            m.add_answer(r);
        }
        m.to_vec().unwrap()
    }

    fn a(owner: &str, ip: &str, ttl: u32) -> Record {
        let ip: std::net::Ipv4Addr = ip.parse().unwrap();
        Record::from_rdata(
            Name::from_ascii(owner).unwrap(),
            ttl,
            RData::A(rdata::A(ip)),
        )
    }

    fn cname(owner: &str, target: &str, ttl: u32) -> Record {
        let target = rdata::CNAME(Name::from_ascii(target).unwrap());
        Record::from_rdata(Name::from_ascii(owner).unwrap(), ttl, RData::CNAME(target))
    }

    fn ips(v: &[&str]) -> Vec<IpAddr> {
        v.iter().map(|i| i.parse().unwrap()).collect()
    }

    #[test]
    fn only_the_question_and_its_cname_chain_are_learned() {
        let query = query(9, "api.example.com.");
        let q = question(&query).unwrap();
        // Cilium (`ExtractMsgDetails`) follows the chain from the question in order; records of
        // other names teach nothing.
        let chain = response(
            &query,
            vec![
                a("evil.test.", "6.6.6.6", 300),
                cname("API.Example.com.", "lb.example.net.", 300),
                a("other.example.net.", "7.7.7.7", 300),
                a("LB.example.NET.", "1.2.3.4", 60),
                a("lb.example.net.", "1.2.3.5", 120),
            ],
        );
        assert_eq!(
            addresses(&chain, &q),
            Some((ips(&["1.2.3.4", "1.2.3.5"]), 60))
        );
        let unrelated = response(&query, vec![a("evil.test.", "6.6.6.6", 300)]);
        assert_eq!(addresses(&unrelated, &q), Some((vec![], 0)));
        let direct = response(&query, vec![a("api.example.com.", "192.0.2.1", 30)]);
        assert_eq!(addresses(&direct, &q), Some((ips(&["192.0.2.1"]), 30)));
        // In order: an address before the CNAME that leads to its name is not on the chain yet.
        let backwards = response(
            &query,
            vec![
                a("lb.example.net.", "1.2.3.4", 60),
                cname("api.example.com.", "lb.example.net.", 300),
            ],
        );
        assert_eq!(addresses(&backwards, &q), Some((vec![], 0)));
        // The CNAME's TTL bounds what is learned through it.
        let short = response(
            &query,
            vec![
                cname("api.example.com.", "lb.example.net.", 5),
                a("lb.example.net.", "1.2.3.4", 300),
            ],
        );
        assert_eq!(addresses(&short, &q), Some((ips(&["1.2.3.4"]), 5)));
        // A loop, and a chain longer than the bound, end without learning anything more.
        let looped = response(
            &query,
            vec![
                cname("api.example.com.", "lb.example.net.", 300),
                cname("lb.example.net.", "api.example.com.", 300),
                cname("api.example.com.", "lb.example.net.", 300),
                a("evil.test.", "6.6.6.6", 300),
            ],
        );
        assert_eq!(addresses(&looped, &q), Some((vec![], 0)));
        let chain_of = |n: usize| {
            let names: Vec<String> = (1..=n).map(|i| format!("c{i}.example.net.")).collect();
            let mut records = vec![cname("api.example.com.", &names[0], 300)];
            for w in names.windows(2) {
                records.push(cname(&w[0], &w[1], 300));
            }
            records.push(a(&names[n - 1], "1.2.3.4", 300));
            response(&query, records)
        };
        assert_eq!(
            addresses(&chain_of(MAX_CNAMES), &q),
            Some((ips(&["1.2.3.4"]), 300))
        );
        assert_eq!(addresses(&chain_of(MAX_CNAMES + 1), &q), Some((vec![], 0)));
        assert_eq!(
            addresses(
                &chain,
                &question(&super::tests::query(10, "api.example.com.")).unwrap()
            ),
            None,
            "another id"
        );
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
        let (ips, ttl) = addresses(&a, &got).unwrap();
        assert_eq!(ips.len(), 2);
        assert_eq!(ttl, 30);
        let other = question(&query(1, "API.Example.com.")).unwrap();
        assert!(
            addresses(&a, &other).is_none(),
            "an answer to another id is no answer"
        );
        assert!(question(&a).is_none(), "a response is no query");
        assert!(question(b"\x00\x01garbage").is_none());
    }
}
