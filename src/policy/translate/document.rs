//! A manifest document as a `serde_yaml::Value`, read where serde_yaml's own `Value` refuses
//! valid YAML: an integer beyond 64 bits (`port: 99999999999999999999999`), which serde_yaml
//! hands over as a 128-bit integer that `Value` cannot hold, becomes the nearest float. The
//! document is then read, and its policy's validation refuses that field by name, instead of
//! the whole file (or the whole world) being refused as not YAML. Everything else is read as
//! `Value` reads it: tags, and a duplicate key refused.

use serde::de::{Deserialize, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess};
use serde_yaml::value::{Tag, TaggedValue};
use serde_yaml::{Mapping, Number, Value};

/// One document (or any part of one), read as described in the module documentation.
#[derive(Debug, Clone, PartialEq)]
pub struct Document(pub Value);

impl<'de> Deserialize<'de> for Document {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DocumentVisitor).map(Document)
    }
}

/// An integer beyond 64 bits, as the nearest float.
fn wide(i: f64) -> Value {
    Value::Number(Number::from(i))
}

struct DocumentVisitor;

impl<'de> serde::de::Visitor<'de> for DocumentVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, i: i64) -> Result<Value, E> {
        Ok(Value::Number(i.into()))
    }

    fn visit_u64<E>(self, u: u64) -> Result<Value, E> {
        Ok(Value::Number(u.into()))
    }

    fn visit_i128<E>(self, i: i128) -> Result<Value, E> {
        Ok(i64::try_from(i).map_or_else(|_| wide(i as f64), |i| Value::Number(i.into())))
    }

    fn visit_u128<E>(self, u: u128) -> Result<Value, E> {
        Ok(u64::try_from(u).map_or_else(|_| wide(u as f64), |u| Value::Number(u.into())))
    }

    fn visit_f64<E>(self, f: f64) -> Result<Value, E> {
        Ok(Value::Number(f.into()))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Document::deserialize(d).map(|x| x.0)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Document::deserialize(d).map(|x| x.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(Document(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Sequence(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Mapping::new();
        while let Some(Document(key)) = map.next_key()? {
            if out.contains_key(&key) {
                let shown = serde_yaml::to_string(&key).unwrap_or_default();
                return Err(serde::de::Error::custom(format_args!(
                    "duplicate entry with key {}",
                    shown.trim_end()
                )));
            }
            let Document(value) = map.next_value()?;
            out.insert(key, value);
        }
        Ok(Value::Mapping(out))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
        let (tag, contents) = data.variant::<String>()?;
        let Document(value) = contents.newtype_variant()?;
        Ok(Value::Tagged(Box::new(TaggedValue {
            tag: Tag::new(tag),
            value,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Value, serde_yaml::Error> {
        serde_yaml::from_str::<Document>(text).map(|d| d.0)
    }

    #[test]
    fn reads_what_value_reads() {
        let text = "a: [1, -2, 3.5, x, true, null, ~]\nb: {c: !Tag d, 'e': \"f\"}\n18446744073709551615: u64\n";
        assert_eq!(
            read(text).unwrap(),
            serde_yaml::from_str::<Value>(text).unwrap()
        );
    }

    #[test]
    fn integers_beyond_64_bits_are_read_as_floats() {
        // `Value` refuses them: the whole document would be lost.
        let text = "port: 99999999999999999999999\nlow: -99999999999999999999999\n";
        assert!(serde_yaml::from_str::<Value>(text).is_err());
        let v = read(text).unwrap();
        assert_eq!(v["port"].as_f64(), Some(1e23));
        assert_eq!(v["port"].as_u64(), None);
        assert_eq!(v["low"].as_f64(), Some(-1e23));
    }

    #[test]
    fn a_duplicate_key_is_refused() {
        let e = read("a: 1\nb: 2\na: 3\n").unwrap_err().to_string();
        assert!(e.contains("duplicate entry with key a"), "{e}");
    }
}
