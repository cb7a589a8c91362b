//! Labels with sources (`k8s:`, `reserved:`, `cidr:`, `any:`), as Cilium models them.
//!
//! A label set is keyed by the label's key *without* its source: two labels with the same key and
//! different sources cannot coexist on one endpoint (Cilium's `labels.Labels` is keyed the same way).

use std::collections::BTreeMap;
use std::fmt;

/// Label source for labels that come from Kubernetes objects.
pub const SOURCE_K8S: &str = "k8s";
/// Label source of Cilium's reserved identities (`reserved:host`, `reserved:world`, ...).
pub const SOURCE_RESERVED: &str = "reserved";
/// Label source of CIDR identities.
pub const SOURCE_CIDR: &str = "cidr";
/// Wildcard source used in selectors: matches a label of any source.
pub const SOURCE_ANY: &str = "any";

/// The label holding an endpoint's namespace.
pub const POD_NAMESPACE_LABEL: &str = "io.kubernetes.pod.namespace";
/// Prefix of the labels that copy the namespace's own labels onto its pods.
pub const NAMESPACE_LABELS_PREFIX: &str = "io.cilium.k8s.namespace.labels.";
/// The label holding a pod's service account.
pub const SERVICE_ACCOUNT_LABEL: &str = "io.cilium.k8s.policy.serviceaccount";
/// The label holding the cluster name (used by the `cluster` entity).
pub const CLUSTER_LABEL: &str = "io.cilium.k8s.policy.cluster";
/// The cluster name ciliate uses (Cilium's default).
pub const DEFAULT_CLUSTER_NAME: &str = "default";

/// One label: `source:key=value`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label {
    pub source: String,
    pub key: String,
    pub value: String,
}

impl Label {
    pub fn new(source: &str, key: &str, value: &str) -> Self {
        Label {
            source: source.to_string(),
            key: key.to_string(),
            value: value.to_string(),
        }
    }

    /// A `k8s:` label.
    pub fn k8s(key: &str, value: &str) -> Self {
        Label::new(SOURCE_K8S, key, value)
    }

    /// A `reserved:` label (value is empty, as in Cilium).
    pub fn reserved(key: &str) -> Self {
        Label::new(SOURCE_RESERVED, key, "")
    }

    /// Parses the `source:key=value` form `Display` writes (`=value` optional).
    pub fn parse(s: &str) -> Option<Label> {
        let (source, rest) = s.split_once(':')?;
        let (key, value) = rest.split_once('=').unwrap_or((rest, ""));
        (!source.is_empty() && !key.is_empty()).then(|| Label::new(source, key, value))
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.value.is_empty() {
            write!(f, "{}:{}", self.source, self.key)
        } else {
            write!(f, "{}:{}={}", self.source, self.key, self.value)
        }
    }
}

/// A set of labels keyed by key (without source). Ordered, so equal sets hash and compare equal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels(BTreeMap<String, Label>);

impl Labels {
    pub fn new() -> Self {
        Labels(BTreeMap::new())
    }

    pub fn insert(&mut self, label: Label) {
        self.0.insert(label.key.clone(), label);
    }

    pub fn get(&self, key: &str) -> Option<&Label> {
        self.0.get(key)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Label> {
        self.0.values()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// True when the set carries `reserved:<key>`.
    pub fn has_reserved(&self, key: &str) -> bool {
        self.get(key).is_some_and(|l| l.source == SOURCE_RESERVED)
    }

    /// Rendered as `source:key=value` strings, in key order.
    pub fn to_strings(&self) -> Vec<String> {
        self.iter().map(|l| l.to_string()).collect()
    }

    /// The label set of a pod: its own labels, its namespace (name and labels), its service
    /// account and the cluster name, all with source `k8s`, exactly as Cilium derives it.
    pub fn for_pod<'a>(
        namespace: &str,
        pod_labels: impl IntoIterator<Item = (&'a String, &'a String)>,
        namespace_labels: impl IntoIterator<Item = (&'a String, &'a String)>,
        service_account: Option<&str>,
    ) -> Labels {
        let mut labels = Labels::new();
        for (k, v) in pod_labels {
            labels.insert(Label::k8s(k, v));
        }
        labels.insert(Label::k8s(POD_NAMESPACE_LABEL, namespace));
        for (k, v) in namespace_labels {
            labels.insert(Label::k8s(&format!("{NAMESPACE_LABELS_PREFIX}{k}"), v));
        }
        // Kubernetes always labels a namespace with its own name.
        labels.insert(Label::k8s(
            &format!("{NAMESPACE_LABELS_PREFIX}kubernetes.io/metadata.name"),
            namespace,
        ));
        if let Some(sa) = service_account.filter(|s| !s.is_empty()) {
            labels.insert(Label::k8s(SERVICE_ACCOUNT_LABEL, sa));
        }
        labels.insert(Label::k8s(CLUSTER_LABEL, DEFAULT_CLUSTER_NAME));
        labels
    }
}

impl FromIterator<Label> for Labels {
    fn from_iter<T: IntoIterator<Item = Label>>(iter: T) -> Self {
        let mut labels = Labels::new();
        for l in iter {
            labels.insert(l);
        }
        labels
    }
}

/// Splits a selector key such as `k8s:app`, `any:app` or `app` into (source, key).
/// A key with no source, or the `any` source, matches labels of every source (`None`).
pub fn split_selector_key(raw: &str) -> (Option<String>, String) {
    // Kubernetes label keys cannot contain ':', so the first colon separates the source.
    match raw.split_once(':') {
        Some((src, key)) if src == SOURCE_ANY => (None, key.to_string()),
        Some((src, key)) => (Some(src.to_string()), key.to_string()),
        None => (None, raw.to_string()),
    }
}

/// The longest label name (the part after any prefix) and label value Kubernetes accepts.
pub const MAX_LABEL_NAME: usize = 63;
/// The longest label-key prefix (a DNS-1123 subdomain) Kubernetes accepts.
pub const MAX_LABEL_PREFIX: usize = 253;

/// A string for an error message: quoted, and cut after 64 characters (a label value of
/// 200 MB must not come back in the message).
pub fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        None => format!("{s:?}"),
        Some((i, _)) => format!("{:?}... ({} bytes)", &s[..i], s.len()),
    }
}

/// `[A-Za-z0-9]`, then `[-A-Za-z0-9_.]*`, ending alphanumeric: the shape of a label name and
/// of a non-empty label value (apimachinery's qualifiedNameFmt / labelValueFmt).
fn is_qualified_token(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric()
                && l.is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// A lowercase RFC 1123 subdomain of at most 253 characters: dot-separated labels of
/// `[a-z0-9-]`, each starting and ending alphanumeric (what the API server takes as most
/// objects' names, and label key prefixes).
pub(crate) fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= MAX_LABEL_PREFIX
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            matches!((b.first(), b.last()), (Some(f), Some(l))
                if (f.is_ascii_lowercase() || f.is_ascii_digit())
                    && (l.is_ascii_lowercase() || l.is_ascii_digit()))
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// Why `key` is not a valid Kubernetes label key, as the API server checks it (apimachinery's
/// `IsQualifiedName`): an optional DNS-1123 subdomain prefix of at most 253 characters and a
/// `/`, then a name of 1 to 63 characters.
pub fn label_key_error(key: &str) -> Option<String> {
    let (prefix, name) = match key.split_once('/') {
        None => (None, key),
        Some((p, n)) if !n.contains('/') => (Some(p), n),
        Some(_) => {
            return Some(
                "a label key is a name with an optional DNS subdomain prefix and one '/'".into(),
            )
        }
    };
    let prefix_error = prefix.and_then(|p| {
        part_error(
            "prefix",
            p,
            MAX_LABEL_PREFIX,
            is_dns1123_subdomain(p),
            "be a lowercase RFC 1123 subdomain (lower-case alphanumeric characters, '-' or '.', each part starting and ending alphanumeric)",
        )
    });
    prefix_error.or_else(|| {
        part_error(
            "name",
            name,
            MAX_LABEL_NAME,
            is_qualified_token(name),
            "consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
        )
    })
}

/// Why one part of a label key is invalid: empty, longer than `max`, or not `well_formed`
/// (`form` says what it must be).
fn part_error(
    part: &str,
    value: &str,
    max: usize,
    well_formed: bool,
    form: &str,
) -> Option<String> {
    if value.is_empty() {
        Some(format!("{part} part must be non-empty"))
    } else if value.len() > max {
        Some(format!("{part} part must be no more than {max} characters"))
    } else if !well_formed {
        Some(format!("{part} part must {form}"))
    } else {
        None
    }
}

/// Why `value` is not a valid Kubernetes label value (apimachinery's `IsValidLabelValue`):
/// empty, or at most 63 characters shaped like a label name.
pub fn label_value_error(value: &str) -> Option<String> {
    if value.len() > MAX_LABEL_NAME {
        return Some(format!("must be no more than {MAX_LABEL_NAME} characters"));
    }
    if !value.is_empty() && !is_qualified_token(value) {
        return Some("must be empty or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into());
    }
    None
}

/// Why a selector key is invalid, as Cilium checks it (`IsValidCiliumLabelKey`): an optional
/// source of letters and digits and a `:`, then a Kubernetes label key.
pub fn selector_key_error(raw: &str) -> Option<String> {
    let key = match raw.split_once(':') {
        None => raw,
        Some((src, key)) => {
            if key.contains(':') {
                return Some(
                    "a selector key has at most one ':', between the source and the key".into(),
                );
            }
            if src.is_empty() || !src.bytes().all(|c| c.is_ascii_alphanumeric()) {
                return Some(
                    "the label source must be a non-empty run of letters and digits".into(),
                );
            }
            key
        }
    };
    label_key_error(key)
}

/// Checks a label map as the API server checks `metadata.labels`; the error names the
/// offending key.
pub fn check_labels<'a>(
    labels: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<(), String> {
    for (k, v) in labels {
        if let Some(m) = label_key_error(k) {
            return Err(format!("label key {}: {m}", shorten(k)));
        }
        if let Some(m) = label_value_error(v) {
            return Err(format!("value {} of label {}: {m}", shorten(v), shorten(k)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_labels_include_namespace_and_cluster() {
        let pod: BTreeMap<String, String> = [("app".to_string(), "web".to_string())].into();
        let ns: BTreeMap<String, String> = [("team".to_string(), "blue".to_string())].into();
        let l = Labels::for_pod("shop", &pod, &ns, Some("default"));
        let s = l.to_strings();
        assert!(s.contains(&"k8s:app=web".to_string()));
        assert!(s.contains(&"k8s:io.kubernetes.pod.namespace=shop".to_string()));
        assert!(s.contains(&"k8s:io.cilium.k8s.namespace.labels.team=blue".to_string()));
        assert!(s.contains(
            &"k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=shop".to_string()
        ));
        assert!(s.contains(&"k8s:io.cilium.k8s.policy.serviceaccount=default".to_string()));
        assert!(s.contains(&"k8s:io.cilium.k8s.policy.cluster=default".to_string()));
    }

    #[test]
    fn selector_keys_split_on_first_colon() {
        assert_eq!(split_selector_key("app"), (None, "app".into()));
        assert_eq!(split_selector_key("any:app"), (None, "app".into()));
        assert_eq!(
            split_selector_key("k8s:app"),
            (Some("k8s".into()), "app".into())
        );
        assert_eq!(
            split_selector_key("reserved:host"),
            (Some("reserved".into()), "host".into())
        );
    }

    #[test]
    fn labels_round_trip_through_text() {
        for l in [
            Label::k8s("app", "web"),
            Label::reserved("host"),
            Label::new("cidr", "10.0.0.0/8", ""),
        ] {
            assert_eq!(Label::parse(&l.to_string()), Some(l));
        }
        assert_eq!(Label::parse("nosource"), None);
    }

    #[test]
    fn equal_sets_are_equal_regardless_of_insert_order() {
        let a: Labels = [Label::k8s("a", "1"), Label::k8s("b", "2")]
            .into_iter()
            .collect();
        let b: Labels = [Label::k8s("b", "2"), Label::k8s("a", "1")]
            .into_iter()
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn label_keys_follow_the_api_server() {
        let long = |n: usize| "a".repeat(n);
        for ok in [
            "app".to_string(),
            "app.kubernetes.io/name".into(),
            "a_b-c.d".into(),
            long(63),
            format!("{}/x", long(253)),
            "io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name".into(),
        ] {
            assert_eq!(label_key_error(&ok), None, "{ok}");
        }
        for (bad, why) in [
            (long(64), "no more than 63"),
            (String::new(), "non-empty"),
            ("/app".into(), "prefix part must be non-empty"),
            ("Example.com/app".into(), "RFC 1123"),
            (format!("{}/x", long(254)), "no more than 253"),
            ("a/b/c".into(), "one '/'"),
            ("-app".into(), "start and end"),
            ("app value".into(), "alphanumeric"),
            ("k8s:app".into(), "alphanumeric"),
        ] {
            let e = label_key_error(&bad).unwrap_or_default();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn label_values_follow_the_api_server() {
        for ok in ["", "v", "a.b_c-d", &"x".repeat(63)] {
            assert_eq!(label_value_error(ok), None, "{ok}");
        }
        for bad in [
            "x".repeat(64),
            "-x".into(),
            "a b".into(),
            "x".repeat(1 << 20),
        ] {
            assert!(label_value_error(&bad).is_some(), "{}", shorten(&bad));
        }
    }

    #[test]
    fn selector_keys_may_carry_a_source() {
        for ok in [
            "k8s:app",
            "any:app",
            "reserved:host",
            "app",
            "k8s:io.kubernetes.pod.namespace",
        ] {
            assert_eq!(selector_key_error(ok), None, "{ok}");
        }
        for bad in ["k8s:", ":app", "k-8s:app", "a:b:c", "k8s:-x"] {
            assert!(selector_key_error(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn label_errors_name_the_key_and_stay_short() {
        let big = "v".repeat(1 << 20);
        let labels: BTreeMap<String, String> = [("app".to_string(), big)].into();
        let e = check_labels(&labels).unwrap_err();
        assert!(
            e.contains("\"app\"") && e.contains("63") && e.len() < 300,
            "{e}"
        );
    }
}
