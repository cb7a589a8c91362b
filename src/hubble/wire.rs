//! A flow's `GetFlowsResponse` written as protobuf bytes for the agent's `GetFlows`, with what
//! recurs across a call's flows encoded once.
//!
//! A history of 10,000 flows names the same few endpoints (each with its labels), DNS names and
//! deciding policies thousands of times. `Writer` encodes each of them once per call (through
//! `convert` and prost, as `to_flow` builds them) and copies the bytes into every flow that
//! names them; the rest of the flow (`convert::bare_flow`) is built and encoded per flow. The
//! copied fields follow the bare flow's: protobuf lets fields come in any order, so a decoder
//! reads exactly the message `convert::to_flow` builds (a test holds the two equal).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use prost::encoding::{encode_key, encode_varint, WireType};
use prost::Message;

use crate::datapath::events::VerdictEvent;
use crate::policy::attribution::PolicyRef;

use super::convert::{self, Lookup, Memo, Side};
use super::proto::observer as opb;

/// `GetFlowsResponse`'s field numbers.
const RESPONSE_FLOW: u32 = 1;
const RESPONSE_NODE_NAME: u32 = 1000;
const RESPONSE_TIME: u32 = 1001;
/// `Flow`'s field numbers of the parts written once per call.
const SOURCE: u32 = 8;
const DESTINATION: u32 = 9;
const SOURCE_NAMES: u32 = 13;
const DESTINATION_NAMES: u32 = 14;

/// One encoded part and what it was made from.
struct Part<K> {
    of: K,
    bytes: Vec<u8>,
}

/// Encoded parts by the hash of their inputs (a part is used only when its inputs are equal
/// too).
struct Parts<K> {
    hasher: foldhash::fast::RandomState,
    parts: HashMap<u64, Vec<Part<K>>>,
}

impl<K> Parts<K> {
    fn new() -> Self {
        Parts {
            hasher: Default::default(),
            parts: HashMap::new(),
        }
    }

    /// The bytes of the part whose inputs hash as `probe` and are `is`; made by `make` (the
    /// inputs kept, and the bytes) the first time.
    fn get(
        &mut self,
        probe: impl Hash,
        is: impl Fn(&K) -> bool,
        make: impl FnOnce() -> (K, Vec<u8>),
    ) -> &[u8] {
        let list = self.parts.entry(self.hasher.hash_one(probe)).or_default();
        let i = match list.iter().position(|p| is(&p.of)) {
            Some(i) => i,
            None => {
                let (of, bytes) = make();
                list.push(Part { of, bytes });
                list.len() - 1
            }
        };
        &list[i].bytes
    }
}

/// A side an endpoint was encoded for (`convert::Side`, kept).
struct SideKey {
    ip: Option<IpAddr>,
    pod: Option<Box<str>>,
    id: u32,
    identity: Option<u32>,
}

impl SideKey {
    fn of(s: &Side<'_>) -> SideKey {
        SideKey {
            ip: s.ip,
            pod: s.pod.map(Box::from),
            id: s.id,
            identity: s.identity,
        }
    }

    fn is(&self, s: &Side<'_>) -> bool {
        (self.ip, self.pod.as_deref(), self.id, self.identity) == (s.ip, s.pod, s.id, s.identity)
    }
}

/// A deciding policy as `convert::policy` reads it, and the list it went in.
#[derive(PartialEq)]
struct PolicyKey {
    list: u32,
    kind: String,
    namespace: Option<String>,
    name: String,
    revision: Option<u64>,
}

impl PolicyKey {
    fn probe<'p>(list: u32, p: &'p PolicyRef, revision: Option<u64>) -> impl Hash + 'p {
        (list, &p.kind, p.namespace.as_deref(), &p.name, revision)
    }

    fn is(&self, list: u32, p: &PolicyRef, revision: Option<u64>) -> bool {
        self.list == list
            && self.kind == p.kind
            && self.namespace == p.namespace
            && self.name == p.name
            && self.revision == revision
    }
}

/// The agent's state as the Observer reads it.
pub type SharedLookup = Arc<dyn Lookup + Send + Sync>;

/// Writes one call's responses. It reads the agent's state once per identity and address
/// (through `Memo`): a call sees the state as of its first flow naming each.
pub struct Writer {
    node: String,
    lookup: Memo<SharedLookup>,
    endpoints: Parts<SideKey>,
    /// The encoded names of each address, by field (source or destination) and address.
    names: Parts<(u32, IpAddr)>,
    /// Encoded `Policy`s, field key included.
    policies: Parts<PolicyKey>,
    /// The flow being written.
    flow: Vec<u8>,
    /// The responses written, handed out one by one.
    out: BytesMut,
}

impl Writer {
    pub fn new(node: &str, lookup: SharedLookup) -> Writer {
        Writer {
            node: node.to_string(),
            lookup: Memo::new(lookup),
            endpoints: Parts::new(),
            names: Parts::new(),
            policies: Parts::new(),
            flow: Vec::new(),
            out: BytesMut::new(),
        }
    }

    /// The agent's state as this writer reads it (for filters that need the whole flow).
    pub fn lookup(&self) -> &dyn Lookup {
        &self.lookup
    }

    /// The encoded `GetFlowsResponse` of flow `ev`, received at `time` (`convert::received`).
    pub fn response(&mut self, ev: &VerdictEvent, time: Option<prost_types::Timestamp>) -> Bytes {
        self.flow.clear();
        convert::bare_flow(ev, &self.node, time).encode_raw(&mut self.flow);
        let (source, destination) = convert::sides(ev);
        self.endpoint(SOURCE, &source);
        self.endpoint(DESTINATION, &destination);
        self.names(SOURCE_NAMES, &source);
        self.names(DESTINATION_NAMES, &destination);
        let (list, revision) = (convert::policy_list(ev), ev.revision);
        for p in &ev.policies {
            let bytes = self.policies.get(
                PolicyKey::probe(list, p, revision),
                |k| k.is(list, p, revision),
                || {
                    let mut b = Vec::new();
                    let policy = convert::policy(p, revision);
                    prost::encoding::message::encode(list, &policy, &mut b);
                    let key = PolicyKey {
                        list,
                        kind: p.kind.clone(),
                        namespace: p.namespace.clone(),
                        name: p.name.clone(),
                        revision,
                    };
                    (key, b)
                },
            );
            self.flow.extend_from_slice(bytes);
        }
        self.finish(time)
    }

    /// Appends one side's endpoint as field `tag`.
    fn endpoint(&mut self, tag: u32, side: &Side<'_>) {
        let lookup = &self.lookup;
        let bytes = self.endpoints.get(
            side,
            |k| k.is(side),
            || {
                let bytes = convert::endpoint(side, lookup).encode_to_vec();
                (SideKey::of(side), bytes)
            },
        );
        encode_key(tag, WireType::LengthDelimited, &mut self.flow);
        encode_varint(bytes.len() as u64, &mut self.flow);
        self.flow.extend_from_slice(bytes);
    }

    /// Appends the DNS names of one side's address as field `tag`.
    fn names(&mut self, tag: u32, side: &Side<'_>) {
        let Some(ip) = side.ip else { return };
        let lookup = &self.lookup;
        let bytes = self.names.get(
            (tag, ip),
            |k| *k == (tag, ip),
            || {
                let mut b = Vec::new();
                prost::encoding::string::encode_repeated(tag, &lookup.names_of(ip), &mut b);
                ((tag, ip), b)
            },
        );
        self.flow.extend_from_slice(bytes);
    }

    /// The response around the flow written.
    fn finish(&mut self, time: Option<prost_types::Timestamp>) -> Bytes {
        let out = &mut self.out;
        out.reserve(self.flow.len() + self.node.len() + 32);
        encode_key(RESPONSE_FLOW, WireType::LengthDelimited, out);
        encode_varint(self.flow.len() as u64, out);
        out.extend_from_slice(&self.flow);
        if !self.node.is_empty() {
            encode_key(RESPONSE_NODE_NAME, WireType::LengthDelimited, out);
            encode_varint(self.node.len() as u64, out);
            out.extend_from_slice(self.node.as_bytes());
        }
        if let Some(t) = &time {
            prost::encoding::message::encode(RESPONSE_TIME, t, out);
        }
        out.split().freeze()
    }
}

/// A response that is not a flow (a loss report), encoded.
pub fn encode(r: &opb::GetFlowsResponse) -> Bytes {
    let mut b = BytesMut::with_capacity(r.encoded_len());
    r.encode_raw(&mut b);
    b.freeze()
}

/// The gRPC codec of `GetFlows` as the agent serves it: responses go out as the bytes `Writer`
/// wrote; the request is decoded as any other.
#[derive(Debug, Default, Clone, Copy)]
pub struct Codec;

/// Writes an encoded response as it is.
#[derive(Debug, Default, Clone, Copy)]
pub struct Encoder;

impl tonic::codec::Encoder for Encoder {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Bytes,
        buf: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put(buf, item);
        Ok(())
    }
}

impl tonic::codec::Codec for Codec {
    type Encode = Bytes;
    type Decode = opb::GetFlowsRequest;
    type Encoder = Encoder;
    type Decoder = tonic_prost::ProstDecoder<opb::GetFlowsRequest>;

    fn encoder(&mut self) -> Encoder {
        Encoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::events::{DnsFields, HttpFields};
    use crate::hubble::convert::tests::{allowed_egress, Known};
    use crate::hubble::proto::observer::get_flows_response::ResponseTypes;

    /// Every kind of record `to_flow` tells apart, with endpoints, names and policies that recur.
    fn records() -> Vec<VerdictEvent> {
        let base = allowed_egress();
        let mut out = vec![base.clone()];
        // Ingress denied by two policies, one of them clusterwide (no namespace).
        let mut e = base.clone();
        e.direction = "ingress".into();
        e.verdict = "dropped".into();
        e.reason = "policy-deny".into();
        e.match_kind = Some("deny-rule".into());
        e.policies.push(PolicyRef {
            kind: "CiliumClusterwideNetworkPolicy".into(),
            namespace: None,
            name: "guard".into(),
            rule: Some(1),
            http: None,
            tier: Default::default(),
        });
        out.push(e);
        // A reply with no policy, no pods and no time; then one not known to be a reply.
        let mut e = base.clone();
        e.reason = "reply".into();
        e.match_kind = None;
        e.policies.clear();
        e.source_pod = None;
        e.destination_pod = None;
        e.time = None;
        out.push(e.clone());
        e.reason = "unmanaged".into();
        out.push(e);
        // An HTTP request the proxy judged.
        let mut e = base.clone();
        e.kind = "l7".into();
        e.http = Some(HttpFields {
            method: "GET".into(),
            url: "http://y/server/api".into(),
            protocol: "HTTP/1.1".into(),
            code: 200,
        });
        e.latency_ns = Some(1500);
        out.push(e);
        // A DNS query refused.
        let mut e = base.clone();
        e.kind = "l7".into();
        e.match_kind = None;
        e.dns = Some(DnsFields {
            pod: "x/client".into(),
            query: "api.example.com.".into(),
            qtype: "A".into(),
            answers: vec![],
            verdict: "refused".into(),
            policies: vec![],
        });
        out.push(e);
        // IPv6 over UDP, with a source port; TCP with flags; the same address as another pod.
        let mut e = base.clone();
        e.protocol = "UDP".into();
        e.source = "fd00::1".into();
        e.destination = "fd00::2".into();
        e.source_port = 5353;
        out.push(e);
        let mut e = base.clone();
        e.tcp_flags = 0x12;
        e.source_port = 40000;
        e.source_pod = Some("x/client-2".into());
        out.push(e);
        // Malformed: no addresses.
        let mut e = base;
        e.source = String::new();
        e.destination = String::new();
        e.verdict = "dropped".into();
        e.reason = "malformed".into();
        out.push(e);
        out
    }

    fn want(ev: &VerdictEvent) -> opb::GetFlowsResponse {
        opb::GetFlowsResponse {
            response_types: Some(ResponseTypes::Flow(Box::new(convert::to_flow(
                ev, "node-1", &Known,
            )))),
            node_name: "node-1".into(),
            time: convert::received(ev),
        }
    }

    #[test]
    fn a_written_response_reads_as_the_flow_to_flow_builds() {
        let records = records();
        let mut w = Writer::new("node-1", Arc::new(Known));
        // Twice: the second pass copies every part the first wrote.
        for pass in 0..2 {
            for ev in &records {
                let bytes = w.response(ev, convert::received(ev));
                let want = want(ev);
                // The same fields (in another order): the same length, and no field twice.
                assert_eq!(bytes.len(), want.encoded_len(), "pass {pass}: {ev:?}");
                let got = opb::GetFlowsResponse::decode(bytes).unwrap();
                assert_eq!(got, want, "pass {pass}: {ev:?}");
            }
        }
    }

    #[test]
    fn parts_are_written_once_per_call_and_told_apart_by_every_input() {
        let records = records();
        let mut w = Writer::new("node-1", Arc::new(Known));
        for ev in &records {
            w.response(ev, None);
        }
        // Sides (address, pod, endpoint id, judged identity): both of the egress, both of the
        // ingress, both without pods, both in IPv6, both without addresses (two each), and
        // 10.0.0.1 as x/client-2: 11.
        fn count<K>(p: &Parts<K>) -> usize {
            p.parts.values().map(Vec::len).sum()
        }
        let endpoints = count(&w.endpoints);
        assert_eq!(endpoints, 11);
        // x/client-out as egress allowed, egress denied and ingress denied; guard once.
        assert_eq!(count(&w.policies), 4);
        for ev in &records {
            w.response(ev, None);
        }
        assert_eq!(
            count(&w.endpoints),
            endpoints,
            "nothing new the second time"
        );
    }

    #[test]
    fn a_loss_report_is_prost_s_encoding() {
        let r = opb::GetFlowsResponse {
            response_types: Some(ResponseTypes::LostEvents(
                crate::hubble::proto::flow::LostEvent {
                    source: 1,
                    num_events_lost: 7,
                    cpu: None,
                },
            )),
            node_name: "n".into(),
            time: None,
        };
        assert_eq!(encode(&r), r.encode_to_vec());
    }
}
