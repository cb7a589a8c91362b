//! DNS names in policy, with Cilium 1.16's semantics (`pkg/fqdn/matchpattern`):
//! - names are case-insensitive and a trailing dot is optional (`API.example.com.` is
//!   `api.example.com`);
//! - `matchName` is one exact name;
//! - `matchPattern`: `*` matches any run (empty included) of the characters of one label
//!   (`[-a-zA-Z0-9_]`), never a dot, so `*.example.com` matches `a.example.com` but neither
//!   `example.com` nor `a.b.example.com`; a lone `*` matches every name. (`**.` is 1.19's
//!   multi-level prefix: in 1.16 it is two `*` and matches one label, as here.)
//!
//! Addresses learned from DNS answers carry one `fqdn:<name>` label per name that resolved to
//! them, on top of their CIDR labels, so that `toFQDNs` selectors select them through the
//! selector cache like any other peer (see `PolicyEngine::learn_fqdn`).

use std::fmt;

/// The label source of names an address was learned for.
pub const SOURCE_FQDN: &str = "fqdn";

/// `name` lower-cased, without its trailing dot.
pub fn normalize(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// A compiled `matchName` or `matchPattern`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FqdnPattern {
    /// Normalized text; for a pattern, with its `*`s.
    text: String,
    pattern: bool,
}

impl FqdnPattern {
    pub fn name(name: &str) -> FqdnPattern {
        FqdnPattern {
            text: normalize(name),
            pattern: false,
        }
    }

    pub fn pattern(pattern: &str) -> FqdnPattern {
        FqdnPattern {
            text: normalize(pattern),
            pattern: true,
        }
    }

    /// Does `name` (any case, trailing dot or not) match?
    pub fn matches(&self, name: &str) -> bool {
        let name = normalize(name);
        if !self.pattern {
            return name == self.text;
        }
        if self.text == "*" {
            return !name.is_empty();
        }
        let (want, have): (Vec<&str>, Vec<&str>) =
            (self.text.split('.').collect(), name.split('.').collect());
        want.len() == have.len() && want.iter().zip(&have).all(|(w, h)| label_matches(w, h))
    }
}

/// One label against one label pattern: `*` matches any run of label characters.
fn label_matches(pattern: &str, label: &str) -> bool {
    let Some((first, rest)) = pattern.split_once('*') else {
        return pattern == label;
    };
    let Some(mut tail) = label.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('*').collect();
    let (last, middle) = parts.split_last().expect("split yields one part at least");
    for part in middle {
        match tail.find(part) {
            Some(i) => tail = &tail[i + part.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last)
}

impl fmt::Display for FqdnPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.pattern {
            write!(f, "matchPattern:{}", self.text)
        } else {
            write!(f, "matchName:{}", self.text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_case_insensitive_and_the_trailing_dot_is_optional() {
        let n = FqdnPattern::name("API.Example.com.");
        for yes in ["api.example.com", "api.example.com.", "API.EXAMPLE.COM"] {
            assert!(n.matches(yes), "{yes}");
        }
        for no in ["example.com", "x.api.example.com", "api.example.co"] {
            assert!(!n.matches(no), "{no}");
        }
    }

    #[test]
    fn a_star_stays_within_one_label() {
        let p = FqdnPattern::pattern("*.example.com");
        assert!(p.matches("a.example.com") && p.matches("A-b_1.Example.COM."));
        assert!(!p.matches("example.com"), "the star needs its own label");
        assert!(!p.matches("a.b.example.com"), "never across a dot");
        assert!(!p.matches("a.example.org"));
        let q = FqdnPattern::pattern("api-*.svc.*.io");
        assert!(q.matches("api-eu.svc.prod.io") && q.matches("api-.svc.x.io"));
        assert!(!q.matches("web-eu.svc.prod.io") && !q.matches("api-eu.svc.io"));
        let inner = FqdnPattern::pattern("a*b*c.test");
        assert!(inner.matches("abc.test") && inner.matches("axxbyyc.test"));
        assert!(!inner.matches("acb.test") && !inner.matches("ab.test"));
    }

    #[test]
    fn a_lone_star_matches_every_name_and_double_star_is_one_label_in_1_16() {
        let all = FqdnPattern::pattern("*");
        assert!(all.matches("a.b.c.example.com") && all.matches("localhost"));
        let two = FqdnPattern::pattern("**.example.com");
        assert!(two.matches("a.example.com"));
        assert!(!two.matches("a.b.example.com"));
    }
}
