//! Label and field selectors as the API server parses them from `labelSelector` and
//! `fieldSelector` query parameters.

use serde_json::Value;

use super::ApiError;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelRequirement {
    /// `key=value` or `key==value`.
    Equals(String, String),
    /// `key!=value`: also true when the key is absent, as in Kubernetes.
    NotEquals(String, String),
    /// `key in (a,b)`.
    In(String, Vec<String>),
    /// `key notin (a,b)`: also true when the key is absent.
    NotIn(String, Vec<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    DoesNotExist(String),
}

/// A parsed `labelSelector`: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<LabelRequirement>,
}

/// Splits on commas that are not inside parentheses (`a in (x,y),b` is two requirements).
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn bad_selector(param: &str, text: &str, why: &str) -> ApiError {
    ApiError::BadRequest(format!("unable to parse {param} {text:?}: {why}"))
}

/// Parses the `(a, b)` value list of a set-based requirement.
fn parse_set(text: &str, whole: &str) -> Result<Vec<String>, ApiError> {
    let inner = text
        .trim()
        .strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'))
        .ok_or_else(|| bad_selector("labelSelector", whole, "expected a list in parentheses"))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

fn check_key(key: &str, whole: &str) -> Result<String, ApiError> {
    let key = key.trim();
    if key.is_empty() || key.contains(char::is_whitespace) {
        return Err(bad_selector("labelSelector", whole, "invalid label key"));
    }
    Ok(key.to_string())
}

impl LabelSelector {
    /// Parses a selector such as `app=web,tier!=db,env in (a,b),!legacy`.
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        let mut requirements = Vec::new();
        for part in split_top_level(text) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let req = if let Some(key) = part.strip_prefix('!') {
                LabelRequirement::DoesNotExist(check_key(key, text)?)
            } else if let Some((k, v)) = part.split_once("!=") {
                LabelRequirement::NotEquals(check_key(k, text)?, v.trim().to_string())
            } else if let Some((k, v)) = part.split_once("==") {
                LabelRequirement::Equals(check_key(k, text)?, v.trim().to_string())
            } else if let Some((k, v)) = part.split_once('=') {
                LabelRequirement::Equals(check_key(k, text)?, v.trim().to_string())
            } else if let Some((k, v)) = part.split_once(" notin ") {
                LabelRequirement::NotIn(check_key(k, text)?, parse_set(v, text)?)
            } else if let Some((k, v)) = part.split_once(" in ") {
                LabelRequirement::In(check_key(k, text)?, parse_set(v, text)?)
            } else {
                LabelRequirement::Exists(check_key(part, text)?)
            };
            requirements.push(req);
        }
        Ok(Self { requirements })
    }

    /// Whether an object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.requirements.iter().all(|r| match r {
            LabelRequirement::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelRequirement::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            LabelRequirement::Exists(k) => get(k).is_some(),
            LabelRequirement::DoesNotExist(k) => get(k).is_none(),
        })
    }
}

/// A parsed `fieldSelector`: `path=value` / `path==value` / `path!=value` terms over dotted
/// field paths (`metadata.name`, `metadata.namespace`, `spec.nodeName`, `status.phase`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    /// (dotted path, value, whether it must equal).
    terms: Vec<(String, String, bool)>,
}

impl FieldSelector {
    /// Parses `metadata.name=x,spec.nodeName!=y`.
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        let mut terms = Vec::new();
        for part in text.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (path, value, equal) = if let Some((k, v)) = part.split_once("!=") {
                (k, v, false)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, v, true)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, v, true)
            } else {
                return Err(bad_selector("fieldSelector", text, "expected path=value"));
            };
            terms.push((path.trim().to_string(), value.trim().to_string(), equal));
        }
        Ok(Self { terms })
    }

    /// Whether the object's fields satisfy every term; a missing field reads as "".
    pub fn matches(&self, object: &Value) -> bool {
        self.terms.iter().all(|(path, value, equal)| {
            let field = path
                .split('.')
                .try_fold(object, |v, seg| v.get(seg))
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    other => other.to_string(),
                })
                .unwrap_or_default();
            (field == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value) -> Value {
        json!({"metadata": {"name": "p", "namespace": "x", "labels": labels}, "spec": {"nodeName": "n1"}})
    }

    #[test]
    fn label_selector_operators() {
        let p = pod(json!({"app": "web", "tier": "front"}));
        let yes = [
            "",
            "app=web",
            "app==web",
            "app!=db",
            "missing!=x",
            "app in (web, db)",
            "app notin (db)",
            "missing notin (db)",
            "tier",
            "!missing",
            "app in (web,db),tier=front,!missing",
        ];
        let no = [
            "app=db",
            "app!=web",
            "app in (db)",
            "app notin (web,x)",
            "missing",
            "!app",
            "app=web,tier=back",
        ];
        for (want, selectors) in [(true, &yes[..]), (false, &no[..])] {
            for s in selectors {
                let sel = LabelSelector::parse(s).unwrap();
                assert_eq!(sel.matches(&p), want, "{s}");
            }
        }
        assert!(LabelSelector::parse("app in web").is_err());
    }

    #[test]
    fn field_selector_paths() {
        let p = pod(json!({}));
        let m = |s: &str| FieldSelector::parse(s).unwrap().matches(&p);
        assert!(m("metadata.name=p"));
        assert!(m("metadata.namespace==x,spec.nodeName=n1"));
        assert!(m("spec.nodeName!=n2"));
        assert!(!m("spec.nodeName=n2"));
        assert!(m("status.phase="));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
