//! Reading another node's `CiliateEndpointSlice` spec straight into its typed form without
//! ever failing the list page or watch event it came in: a value of the wrong type is skipped
//! (lists and objects drained) and the spec reads as what is wrong and where,
//! `spec.endpoints[3].ips[0]: expected a string, found a number`. One malformed slice is
//! reported by itself; its neighbours in the list are read as usual. Unknown fields are
//! ignored, as serde's derive ignores them. Only malformed JSON, which leaves nothing readable
//! after it, still fails the document.
//!
//! (The spec used to be kept as a `serde_json::Value` and typed afterwards: at 150,000 pods a
//! fifth of an agent's sync went to building and walking those trees. `RawValue` is no way
//! out: kube's watch events are adjacently tagged, so serde buffers an event whose `object`
//! comes before its `type` (no API server writes them so, but nothing promises it), and a
//! buffered value cannot be borrowed as raw text.)

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::slices::{CiliateEndpointSliceSpec, SliceEndpoint, SliceNamedPort, SliceProfile};

/// A slice's spec as read: typed, or what is wrong with it, by field (`spec.…: …`).
#[derive(Clone, Debug, PartialEq)]
pub struct SpecRead(pub Result<CiliateEndpointSliceSpec, String>);

impl<'de> Deserialize<'de> for SpecRead {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let read = d.deserialize_any(ReadVisitor::<CiliateEndpointSliceSpec>(PhantomData))?;
        Ok(SpecRead(
            read.map_err(|bad| format!("spec{}: {}", bad.path, bad.msg)),
        ))
    }
}

/// What is wrong with a value, and where below the value being read (`.endpoints[3].ips[0]`).
#[derive(Debug)]
struct Bad {
    path: String,
    msg: String,
}

impl Bad {
    fn new(msg: String) -> Bad {
        Bad {
            path: String::new(),
            msg,
        }
    }

    fn under(mut self, segment: &str) -> Bad {
        self.path.insert_str(0, segment);
        self
    }
}

type Read<T> = Result<T, Bad>;

/// A type read leniently. Each method reads one shape of JSON value; the defaults say the
/// shape is wrong (after draining what the shape holds, so that the reader stays in step).
trait Lenient: Sized {
    /// What the value should be, for messages (`a string`).
    const WHAT: &'static str;

    fn wrong(found: &str) -> Read<Self> {
        Err(Bad::new(format!("expected {}, found {found}", Self::WHAT)))
    }
    fn from_str(_: &str) -> Read<Self> {
        Self::wrong("a string")
    }
    fn from_string(s: String) -> Read<Self> {
        Self::from_str(&s)
    }
    fn from_u64(_: u64) -> Read<Self> {
        Self::wrong("a number")
    }
    fn from_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<Read<Self>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Self::wrong("an object"))
    }
    fn from_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<Read<Self>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Self::wrong("a list"))
    }
}

/// A `T` read leniently, as a field or element of something larger.
struct Field<T>(Read<T>);

impl<'de, T: Lenient> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ReadVisitor::<T>(PhantomData)).map(Field)
    }
}

struct ReadVisitor<T>(PhantomData<T>);

impl<'de, T: Lenient> Visitor<'de> for ReadVisitor<T> {
    type Value = Read<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(T::WHAT)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Read<T>, E> {
        Ok(T::wrong("a boolean"))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Read<T>, E> {
        match u64::try_from(v) {
            Ok(v) => Ok(T::from_u64(v)),
            Err(_) => Ok(T::wrong("a negative number")),
        }
    }
    fn visit_u64<E>(self, v: u64) -> Result<Read<T>, E> {
        Ok(T::from_u64(v))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Read<T>, E> {
        Ok(T::wrong("a fractional number"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Read<T>, E> {
        Ok(T::from_str(v))
    }
    fn visit_string<E>(self, v: String) -> Result<Read<T>, E> {
        Ok(T::from_string(v))
    }
    fn visit_bytes<E>(self, _: &[u8]) -> Result<Read<T>, E> {
        Ok(T::wrong("bytes"))
    }
    fn visit_unit<E>(self) -> Result<Read<T>, E> {
        Ok(T::wrong("null"))
    }
    fn visit_none<E>(self) -> Result<Read<T>, E> {
        Ok(T::wrong("null"))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Read<T>, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Read<T>, A::Error> {
        T::from_map(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Read<T>, A::Error> {
        T::from_seq(seq)
    }
}

impl Lenient for String {
    const WHAT: &'static str = "a string";
    fn from_str(s: &str) -> Read<String> {
        Ok(s.to_owned())
    }
    fn from_string(s: String) -> Read<String> {
        Ok(s)
    }
}

macro_rules! lenient_uint {
    ($t:ty) => {
        impl Lenient for $t {
            const WHAT: &'static str = concat!("an integer that fits ", stringify!($t));
            fn from_u64(v: u64) -> Read<$t> {
                <$t>::try_from(v).or_else(|_| Self::wrong(&format!("{v}")))
            }
        }
    };
}
lenient_uint!(u16);
lenient_uint!(u32);

impl<T: Lenient> Lenient for Vec<T> {
    const WHAT: &'static str = "a list";
    fn from_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<Read<Vec<T>>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        let mut bad = None;
        while let Some(Field(item)) = seq.next_element::<Field<T>>()? {
            match item {
                Ok(item) if bad.is_none() => out.push(item),
                Ok(_) => {}
                Err(e) => {
                    let i = out.len();
                    bad.get_or_insert_with(|| e.under(&format!("[{i}]")));
                }
            }
        }
        Ok(bad.map_or(Ok(out), Err))
    }
}

impl Lenient for BTreeMap<String, String> {
    const WHAT: &'static str = "an object";
    fn from_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<Read<Self>, A::Error> {
        let mut out = BTreeMap::new();
        let mut bad = None;
        while let Some(key) = map.next_key::<String>()? {
            let Field(value) = map.next_value::<Field<String>>()?;
            match value {
                Ok(v) => {
                    out.insert(key, v);
                }
                Err(e) => {
                    bad.get_or_insert_with(|| e.under(&format!("[{:?}]", short(&key))));
                }
            }
        }
        Ok(bad.map_or(Ok(out), Err))
    }
}

/// A key as a message quotes it: another node's slice says what it is, so at most 64
/// characters of it.
fn short(key: &str) -> String {
    match key.char_indices().nth(64) {
        Some((at, _)) => format!("{}...", &key[..at]),
        None => key.to_string(),
    }
}

/// The fields of one object, by name: the known ones read leniently, the first thing wrong
/// kept with its field's name, unknown ones skipped.
struct Fields<'a> {
    names: &'static [&'static str],
    bad: &'a mut Option<Bad>,
}

impl Fields<'_> {
    /// Reads the map; `take(i, map, bad)` is called for the field `names[i]`.
    fn read<'de, A: MapAccess<'de>>(
        self,
        mut map: A,
        mut take: impl FnMut(usize, &mut A, &mut Option<Bad>) -> Result<(), A::Error>,
    ) -> Result<(), A::Error> {
        while let Some(key) = map.next_key_seed(Names(self.names))? {
            match key {
                Some(i) => take(i, &mut map, self.bad)?,
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// Reads one field's value into `slot`, or records what is wrong with it under `.name`.
fn take<'de, A: MapAccess<'de>, T: Lenient>(
    map: &mut A,
    name: &str,
    slot: &mut Option<T>,
    bad: &mut Option<Bad>,
) -> Result<(), A::Error> {
    let Field(value) = map.next_value::<Field<T>>()?;
    match value {
        Ok(v) => *slot = Some(v),
        Err(e) => {
            bad.get_or_insert_with(|| e.under(&format!(".{name}")));
        }
    }
    Ok(())
}

/// A required field that was not there.
fn required<T>(slot: Option<T>, name: &str) -> Read<T> {
    slot.ok_or_else(|| Bad::new("required".into()).under(&format!(".{name}")))
}

/// A key of an object: the index of its name among the fields read, or `None` (skipped).
struct Names(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for Names {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl<'de> Visitor<'de> for Names {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }
    fn visit_str<E>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|n| *n == v))
    }
    fn visit_bytes<E>(self, v: &[u8]) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|n| n.as_bytes() == v))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Option<usize>, E> {
        Ok(None)
    }
}

impl Lenient for CiliateEndpointSliceSpec {
    const WHAT: &'static str = "an object";
    fn from_map<'de, A: MapAccess<'de>>(map: A) -> Result<Read<Self>, A::Error> {
        let (mut node, mut profiles, mut endpoints, mut bad) = (None, None, None, None);
        let names = &["node", "profiles", "endpoints"];
        Fields {
            names,
            bad: &mut bad,
        }
        .read(map, |i, map, bad| match i {
            0 => take(map, "node", &mut node, bad),
            1 => take(map, "profiles", &mut profiles, bad),
            _ => take(map, "endpoints", &mut endpoints, bad),
        })?;
        Ok(bad.map_or_else(
            || {
                Ok(CiliateEndpointSliceSpec {
                    node: required(node, "node")?,
                    profiles: profiles.unwrap_or_default(),
                    endpoints: endpoints.unwrap_or_default(),
                })
            },
            Err,
        ))
    }
}

impl Lenient for SliceProfile {
    const WHAT: &'static str = "an object";
    fn from_map<'de, A: MapAccess<'de>>(map: A) -> Result<Read<Self>, A::Error> {
        let (mut namespace, mut labels, mut sa, mut ports, mut bad) =
            (None, None, None, None, None);
        let names = &["namespace", "labels", "serviceAccount", "namedPorts"];
        Fields {
            names,
            bad: &mut bad,
        }
        .read(map, |i, map, bad| match i {
            0 => take(map, "namespace", &mut namespace, bad),
            1 => take(map, "labels", &mut labels, bad),
            2 => take(map, "serviceAccount", &mut sa, bad),
            _ => take(map, "namedPorts", &mut ports, bad),
        })?;
        Ok(bad.map_or_else(
            || {
                Ok(SliceProfile {
                    namespace: required(namespace, "namespace")?,
                    labels: labels.unwrap_or_default(),
                    service_account: sa.unwrap_or_else(|| "default".into()),
                    named_ports: ports.unwrap_or_default(),
                })
            },
            Err,
        ))
    }
}

impl Lenient for SliceNamedPort {
    const WHAT: &'static str = "an object";
    fn from_map<'de, A: MapAccess<'de>>(map: A) -> Result<Read<Self>, A::Error> {
        let (mut name, mut port, mut protocol, mut bad) = (None, None, None, None);
        Fields {
            names: &["name", "port", "protocol"],
            bad: &mut bad,
        }
        .read(map, |i, map, bad| match i {
            0 => take(map, "name", &mut name, bad),
            1 => take(map, "port", &mut port, bad),
            _ => take(map, "protocol", &mut protocol, bad),
        })?;
        Ok(bad.map_or_else(
            || {
                Ok(SliceNamedPort {
                    name: required(name, "name")?,
                    port: required(port, "port")?,
                    protocol: protocol.unwrap_or_else(|| "TCP".into()),
                })
            },
            Err,
        ))
    }
}

impl Lenient for SliceEndpoint {
    const WHAT: &'static str = "an object";
    fn from_map<'de, A: MapAccess<'de>>(map: A) -> Result<Read<Self>, A::Error> {
        let (mut name, mut ips, mut profile, mut bad) = (None, None, None, None);
        Fields {
            names: &["name", "ips", "profile"],
            bad: &mut bad,
        }
        .read(map, |i, map, bad| match i {
            0 => take(map, "name", &mut name, bad),
            1 => take(map, "ips", &mut ips, bad),
            _ => take(map, "profile", &mut profile, bad),
        })?;
        Ok(bad.map_or_else(
            || {
                Ok(SliceEndpoint {
                    name: required(name, "name")?,
                    ips: required(ips, "ips")?,
                    profile: required(profile, "profile")?,
                })
            },
            Err,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A list of slice specs, as a list page holds them, read in one pass.
    fn read_list(text: &str) -> Vec<Result<CiliateEndpointSliceSpec, String>> {
        #[derive(Deserialize)]
        struct Page {
            items: Vec<SpecRead>,
        }
        let page: Page = serde_json::from_str(text).expect("the page reads");
        page.items.into_iter().map(|s| s.0).collect()
    }

    fn good() -> serde_json::Value {
        json!({"node": "n1", "unknown": {"x": [1, 2]},
               "profiles": [{"namespace": "a", "labels": {"app": "web", "tier": "front"},
                             "namedPorts": [{"name": "http", "port": 8080},
                                            {"name": "dns", "port": 53, "protocol": "UDP"}]},
                            {"namespace": "b", "serviceAccount": "sa"}],
               "endpoints": [{"name": "web-0", "ips": ["10.0.0.1"], "profile": 0},
                             {"name": "api-0", "ips": ["10.0.0.2", "fd00::2"], "profile": 1}]})
    }

    #[test]
    fn a_good_spec_reads_as_serde_derive_reads_it() {
        let text = good().to_string();
        let derived: CiliateEndpointSliceSpec = serde_json::from_str(&text).unwrap();
        let read = read_list(&format!("{{\"items\": [{text}]}}"));
        assert_eq!(read, vec![Ok(derived.clone())]);
        assert_eq!(derived.profiles[1].service_account, "sa");
        assert_eq!(derived.profiles[0].service_account, "default");
        assert_eq!(derived.profiles[0].named_ports[0].protocol, "TCP");
        // Buffered first (as serde buffers kube's adjacently tagged watch events): the same.
        let buffered: SpecRead = serde_json::from_value(good()).unwrap();
        assert_eq!(buffered.0, Ok(derived));
    }

    /// Each malformed spec is reported by field, and the good specs beside it in the same
    /// list still read.
    #[test]
    fn a_malformed_spec_is_named_by_field_and_spares_its_neighbours() {
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (json!({"profiles": []}), "spec.node: required"),
            (json!(7), "spec: expected an object, found a number"),
            (json!({"node": ["n"]}), "spec.node: expected a string, found a list"),
            (
                json!({"node": "n", "endpoints": [{"name": "e", "ips": ["1.1.1.1"], "profile": 0},
                                                  {"name": "f", "ips": [7], "profile": 0}]}),
                "spec.endpoints[1].ips[0]: expected a string, found a number",
            ),
            (
                json!({"node": "n", "endpoints": [{"name": "e", "ips": [], "profile": -1}]}),
                "spec.endpoints[0].profile: expected an integer that fits u32, found a negative number",
            ),
            (
                json!({"node": "n", "profiles": [{"namespace": "a",
                       "namedPorts": [{"name": "p", "port": 70000}]}]}),
                "spec.profiles[0].namedPorts[0].port: expected an integer that fits u16, found 70000",
            ),
            (
                json!({"node": "n", "profiles": [{"namespace": "a", "labels": {"app": {"x": 1}}}]}),
                "spec.profiles[0].labels[\"app\"]: expected a string, found an object",
            ),
            (
                json!({"node": "n", "profiles": [{"namespace": "a", "labels": {("k".repeat(5000)): 1}}]}),
                "spec.profiles[0].labels[\"kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk...\"]: expected a string, found a number",
            ),
            (
                json!({"node": "n", "profiles": [{"namespace": "a", "labels": null}]}),
                "spec.profiles[0].labels: expected an object, found null",
            ),
            (
                json!({"node": "n", "endpoints": [{"name": "e", "profile": 0.5, "ips": []}]}),
                "spec.endpoints[0].profile: expected an integer that fits u32, found a fractional number",
            ),
            (
                json!({"node": "n", "endpoints": [{"name": "e", "profile": 0}]}),
                "spec.endpoints[0].ips: required",
            ),
        ];
        for (bad, want) in cases {
            let text = format!("{{\"items\": [{}, {bad}, {}]}}", good(), good());
            let read = read_list(&text);
            assert_eq!(read.len(), 3, "{bad}");
            assert!(read[0].is_ok() && read[2].is_ok(), "{bad}: {read:?}");
            assert_eq!(read[1].as_ref().unwrap_err(), want, "{bad}");
            // Buffered, the same verdict.
            let buffered: SpecRead = serde_json::from_value(bad.clone()).unwrap();
            assert_eq!(buffered.0.unwrap_err(), want, "{bad}");
        }
    }

    /// As the agent receives slices: in list pages (streamed) and in watch events (which
    /// serde buffers), a malformed one reads as its error and the page reads on.
    #[test]
    fn list_pages_and_watch_events_carry_a_malformed_slice_as_its_error() {
        use crate::k8s::slices::SliceObject;
        use kube::core::{ObjectList, WatchEvent};
        let object = |spec: serde_json::Value| {
            json!({"apiVersion": "ciliate.io/v1alpha1", "kind": "CiliateEndpointSlice",
                   "metadata": {"name": "n1.0"}, "spec": spec})
        };
        let want = "spec.node: expected a string, found a number";
        let event = json!({"type": "MODIFIED", "object": object(json!({"node": 5}))});
        let event: WatchEvent<SliceObject> = serde_json::from_str(&event.to_string()).unwrap();
        let WatchEvent::Modified(o) = event else {
            panic!("{event:?}")
        };
        assert_eq!(o.spec_of().unwrap_err(), want);
        let event = json!({"type": "ADDED", "object": object(good())});
        let event: WatchEvent<SliceObject> = serde_json::from_str(&event.to_string()).unwrap();
        let WatchEvent::Added(o) = event else {
            panic!("{event:?}")
        };
        assert_eq!(o.spec_of().unwrap().endpoints.len(), 2);
        let page = json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "9"},
            "items": [object(good()), object(json!({"node": 5})), {"metadata": {"name": "x"}}]});
        let page: ObjectList<SliceObject> = serde_json::from_str(&page.to_string()).unwrap();
        let specs: Vec<_> = page
            .items
            .iter()
            .map(|o| o.spec_of().map(|s| s.node.clone()))
            .collect();
        assert_eq!(
            specs,
            vec![
                Ok("n1".into()),
                Err(want.into()),
                Err("spec: required".into())
            ]
        );
    }
}
