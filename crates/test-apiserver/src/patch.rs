//! Patch formats: JSON merge patch (RFC 7386) and an approximation of strategic merge patch.

use serde_json::{Map, Value};

/// Applies an RFC 7386 JSON merge patch: objects merge recursively, `null` removes a key, any
/// other value (arrays included) replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// Keys that identify elements of lists the strategic merge patch merges by key; the real
/// server reads the merge key from the Go types, which we do not have.
const MERGE_KEYS: [&str; 5] = ["name", "containerPort", "port", "mountPath", "ip"];

/// The merge key shared by every element of both lists, if any.
fn merge_key(target: &[Value], patch: &[Value]) -> Option<&'static str> {
    MERGE_KEYS
        .into_iter()
        .find(|k| !patch.is_empty() && target.iter().chain(patch).all(|e| e.get(k).is_some()))
}

/// Applies a strategic merge patch the way kubectl's patches need it: like a merge patch, but
/// lists of objects with a common merge key (`name`, `port`, ...) merge element by element,
/// `$patch: delete` removes an element, and the other `$` directives (`$setElementOrder`,
/// `$retainKeys`, ...) are dropped rather than stored.
pub fn strategic_merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if patch.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut replacement = Value::Object(patch.clone());
        strip_directives(&mut replacement);
        *target = replacement;
        return;
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else { return };
    for (k, v) in patch {
        if k.starts_with('$') {
            continue;
        }
        match v {
            Value::Null => {
                t.remove(k);
            }
            Value::Array(items) => {
                let existing = t.get(k).and_then(Value::as_array).cloned();
                let merged = match existing {
                    Some(old) => match merge_key(&old, items) {
                        Some(key) => merge_list(old, items, key),
                        None => strip_all(items),
                    },
                    None => strip_all(items),
                };
                t.insert(k.clone(), Value::Array(merged));
            }
            Value::Object(_) => strategic_merge_patch(t.entry(k.clone()).or_insert(Value::Null), v),
            other => {
                t.insert(k.clone(), other.clone());
            }
        }
    }
}

fn merge_list(mut old: Vec<Value>, patch: &[Value], key: &str) -> Vec<Value> {
    for item in patch {
        let id = item.get(key);
        let position = old.iter().position(|e| e.get(key) == id);
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (position, delete) {
            (Some(i), true) => {
                old.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => strategic_merge_patch(&mut old[i], item),
            (None, false) => {
                let mut fresh = item.clone();
                strip_directives(&mut fresh);
                old.push(fresh);
            }
        }
    }
    old
}

fn strip_all(items: &[Value]) -> Vec<Value> {
    items
        .iter()
        .filter(|e| e.get("$patch").and_then(Value::as_str) != Some("delete"))
        .cloned()
        .map(|mut e| {
            strip_directives(&mut e);
            e
        })
        .collect()
}

/// Removes `$`-prefixed directive keys, recursively.
fn strip_directives(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|k, _| !k.starts_with('$'));
            m.values_mut().for_each(strip_directives);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_directives),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(
            &mut t,
            &json!({"a": "z", "c": {"f": null}, "l": [3], "n": {"x": 1}}),
        );
        assert_eq!(
            t,
            json!({"a": "z", "c": {"d": "e"}, "l": [3], "n": {"x": 1}})
        );
    }

    #[test]
    fn strategic_patch_merges_lists_by_key_and_drops_directives() {
        let mut t = json!({"spec": {"containers": [
            {"name": "a", "image": "x"}, {"name": "b", "image": "y"}]}});
        let p = json!({"spec": {
            "$setElementOrder/containers": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
            "containers": [{"name": "a", "image": "x2"}, {"name": "b", "$patch": "delete"},
                           {"name": "c", "image": "z"}]}});
        strategic_merge_patch(&mut t, &p);
        assert_eq!(
            t,
            json!({"spec": {"containers": [{"name": "a", "image": "x2"}, {"name": "c", "image": "z"}]}})
        );
        let mut m = json!({"metadata": {"annotations": {"a": "1", "b": "2"}}});
        strategic_merge_patch(
            &mut m,
            &json!({"metadata": {"annotations": {"a": null, "c": "3"}}}),
        );
        assert_eq!(
            m,
            json!({"metadata": {"annotations": {"b": "2", "c": "3"}}})
        );
    }
}
