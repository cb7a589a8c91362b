//! Verdict attribution: every policy map entry carries a 32-bit cookie naming the rules it was
//! derived from and the kind of match (L3 only, L3+L4, L4 only, everything, a deny rule), and
//! every endpoint record the cookie of the policies that isolate it in each direction (a
//! default deny). The datapath copies the deciding cookie into its verdict event; the agent
//! resolves it here.
//!
//! Cookies are a hash of what they stand for (FNV-1a over the policies' kind, namespace, name
//! and rule path), not a counter: the same rules get the same cookie in every run, so entries
//! an earlier run left in the pinned maps resolve after a restart, and an event always resolves
//! to what the entry said when the packet met it, never to a later edit (an edited rule set is
//! another cookie). 0 means "not attributed" (entries of an older version).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use serde::Serialize;

use super::mapstate::MapKey;
use super::rule::{PolicyKey, PolicyKind, RuleOrigin};

pub type Cookie = u32;

/// How a verdict matched (Hubble's `match` words).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MatchKind {
    /// A peer identity, every port.
    L3Only,
    /// A peer identity and a port.
    L3L4,
    /// Any peer, a port.
    L4Only,
    /// Any peer, every port.
    All,
    /// A deny rule.
    DenyRule,
    /// No entry matched and policies isolate the endpoint.
    DefaultDeny,
    /// No policy selects the endpoint in that direction.
    NoPolicy,
}

impl MatchKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MatchKind::L3Only => "l3-only",
            MatchKind::L3L4 => "l3-l4",
            MatchKind::L4Only => "l4-only",
            MatchKind::All => "all",
            MatchKind::DenyRule => "deny-rule",
            MatchKind::DefaultDeny => "default-deny",
            MatchKind::NoPolicy => "no-policy",
        }
    }

    /// The kind of match an entry stands for.
    pub fn of_entry(key: &MapKey, deny: bool) -> MatchKind {
        if deny {
            return MatchKind::DenyRule;
        }
        let every_port = key.protocol == 0 || (key.port_lo == 0 && key.port_hi == u16::MAX);
        match (key.identity != 0, every_port) {
            (true, true) => MatchKind::L3Only,
            (true, false) => MatchKind::L3L4,
            (false, false) => MatchKind::L4Only,
            (false, true) => MatchKind::All,
        }
    }
}

/// One policy a verdict names (`policies` of a flow).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize)]
pub struct PolicyRef {
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
    /// The rule's index in its section (`spec.ingress[1]` -> 1); absent for a default deny.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<usize>,
    /// In L7 flows: the HTTP rule of that rule that matched (`http[1]` -> 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<usize>,
    /// The tier the rule is evaluated in.
    #[serde(default)]
    pub tier: PolicyTier,
}

/// A flow's policy's tier, as interfaces section 12 names it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyTier {
    Admin,
    #[default]
    NetworkPolicy,
    Baseline,
}

impl PolicyTier {
    /// As flow events and `monitor --tier` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyTier::Admin => "admin",
            PolicyTier::NetworkPolicy => "network-policy",
            PolicyTier::Baseline => "baseline",
        }
    }

    /// The tier of a rule (`None`: the NetworkPolicy tier's).
    pub fn of(t: Option<crate::policy::rule::Tier>) -> PolicyTier {
        match t {
            Some(crate::policy::rule::Tier::Admin) => PolicyTier::Admin,
            Some(crate::policy::rule::Tier::Baseline) => PolicyTier::Baseline,
            None => PolicyTier::NetworkPolicy,
        }
    }

    /// The tier of a policy of `kind` when only its key is known (a default deny names
    /// policies, not rules): a ClusterNetworkPolicy's is in its spec, not its key, and the
    /// only policies of that kind a default names are Admin ones (`EndpointPolicy::isolated_by`).
    pub fn of_kind(kind: crate::kinds::PolicyKind) -> PolicyTier {
        use crate::kinds::PolicyKind as K;
        match kind {
            K::AdminNetworkPolicy | K::ClusterNetworkPolicy => PolicyTier::Admin,
            K::BaselineAdminNetworkPolicy => PolicyTier::Baseline,
            _ => PolicyTier::NetworkPolicy,
        }
    }
}

impl PolicyRef {
    fn of_policy(p: &PolicyKey, rule: Option<usize>) -> PolicyRef {
        PolicyRef {
            kind: p.kind.as_str().to_string(),
            namespace: p.namespace.clone(),
            name: p.name.clone(),
            rule,
            http: None,
            tier: PolicyTier::of_kind(p.kind),
        }
    }

    /// Whether this names the policy `p`.
    pub fn names(&self, p: &PolicyKey) -> bool {
        self.kind == p.kind.as_str() && self.namespace == p.namespace && self.name == p.name
    }

    /// The policy and rule an origin names.
    pub fn of_rule(o: &crate::policy::rule::RuleOrigin) -> PolicyRef {
        PolicyRef {
            kind: o.policy.kind.as_str().to_string(),
            namespace: o.policy.namespace.clone(),
            name: o.policy.name.clone(),
            rule: o.index(),
            http: None,
            tier: PolicyTier::of(o.tier),
        }
    }

    /// `Kind ns/name[rule]`, as verdicts name rules everywhere (`RuleOrigin::describe`), with
    /// ` http[i]` in L7 flows.
    pub fn named(&self) -> String {
        let mut out = String::new();
        self.write_named(&mut out);
        out
    }

    /// `named` appended to `out`.
    pub fn write_named(&self, out: &mut String) {
        use std::fmt::Write;
        out.push_str(&self.kind);
        out.push(' ');
        if let Some(ns) = &self.namespace {
            out.push_str(ns);
            out.push('/');
        }
        out.push_str(&self.name);
        if let Some(r) = self.rule {
            let _ = write!(out, "[{r}]");
        }
        if let Some(h) = self.http {
            let _ = write!(out, " http[{h}]");
        }
    }

    /// `ns/name` (or `name`), with `[rule]`.
    pub fn short(&self) -> String {
        let name = match &self.namespace {
            Some(ns) => format!("{ns}/{}", self.name),
            None => self.name.clone(),
        };
        match self.rule {
            Some(r) => format!("{name}[{r}]"),
            None => name,
        }
    }
}

/// What a cookie stands for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attribution {
    #[serde(rename = "match")]
    pub match_kind: MatchKind,
    pub policies: Vec<PolicyRef>,
    /// The policy revision the cookie was first realized at.
    pub revision: u64,
}

fn fnv1a32(h: &mut u32, bytes: &[u8]) {
    for b in bytes {
        *h ^= *b as u32;
        *h = h.wrapping_mul(0x0100_0193);
    }
}

fn finish(h: u32) -> Cookie {
    // 0 is "not attributed".
    if h == 0 {
        1
    } else {
        h
    }
}

fn policy_words(h: &mut u32, p: &PolicyKey) {
    fnv1a32(h, p.kind.as_str().as_bytes());
    fnv1a32(h, b"\0");
    fnv1a32(h, p.namespace.as_deref().unwrap_or("").as_bytes());
    fnv1a32(h, b"\0");
    fnv1a32(h, p.name.as_bytes());
    fnv1a32(h, b"\0");
}

/// The cookie of an entry derived from `origins` (in any order) matching as `kind`, and what
/// it stands for.
pub fn entry_cookie(origins: &[Arc<RuleOrigin>], kind: MatchKind) -> (Cookie, Vec<PolicyRef>) {
    let refs: BTreeSet<(&PolicyKey, &str, Option<crate::policy::rule::Tier>)> = origins
        .iter()
        .filter(|o| o.policy.kind != PolicyKind::Builtin)
        .map(|o| (o.policy.as_ref(), o.path.as_str(), o.tier))
        .collect();
    let mut h = 0x811c_9dc5u32;
    fnv1a32(&mut h, kind.as_str().as_bytes());
    let mut policies = Vec::with_capacity(refs.len());
    for (p, path, tier) in refs {
        policy_words(&mut h, p);
        fnv1a32(&mut h, path.as_bytes());
        fnv1a32(&mut h, b"\n");
        policies.push(PolicyRef {
            tier: PolicyTier::of(tier),
            ..PolicyRef::of_policy(p, crate::policy::rule::rule_index(path))
        });
    }
    (finish(h), policies)
}

/// The cookie of a default deny by the policies that isolate an endpoint in one direction;
/// 0 when none does (nothing to attribute: the direction is not enforced).
pub fn isolation_cookie(isolated_by: &[Arc<PolicyKey>]) -> (Cookie, Vec<PolicyRef>) {
    let keys = isolating_keys(isolated_by);
    let policies = keys.iter().map(|p| PolicyRef::of_policy(p, None)).collect();
    (isolation_cookie_of(keys.into_iter()), policies)
}

/// [`isolation_cookie`]'s cookie alone, without naming the policies: what an endpoint's
/// regeneration computes every time (an endpoint under a thousand cluster-wide policies named
/// them all, a thousand allocations, on every regeneration), naming them only for a cookie
/// the jar does not know yet.
pub fn isolation_cookie_value(isolated_by: &[Arc<PolicyKey>]) -> Cookie {
    // The engine lists them in order, each once: then no copy of the list either.
    if isolated_by.windows(2).all(|w| w[0] < w[1]) {
        return isolation_cookie_of(isolated_by.iter().map(|p| p.as_ref()));
    }
    isolation_cookie_of(isolating_keys(isolated_by).into_iter())
}

/// The distinct policies, in order (the engine lists them so already: then no sort).
fn isolating_keys(isolated_by: &[Arc<PolicyKey>]) -> Vec<&PolicyKey> {
    let mut keys: Vec<&PolicyKey> = isolated_by.iter().map(|p| p.as_ref()).collect();
    if !keys.windows(2).all(|w| w[0] < w[1]) {
        keys.sort_unstable();
        keys.dedup();
    }
    keys
}

/// Hashed eight bytes at a time (Fx, unkeyed: the same cookie in every run), not byte by byte
/// as FNV: an endpoint isolated by a thousand cluster-wide policies hashes all their names on
/// every regeneration (3.6 % of the CPU of a change selecting 1,000 endpoints, FNV).
fn isolation_cookie_of<'a>(keys: impl Iterator<Item = &'a PolicyKey>) -> Cookie {
    use std::hash::Hasher;
    let mut h = rustc_hash::FxHasher::default();
    h.write(MatchKind::DefaultDeny.as_str().as_bytes());
    let mut any = false;
    for p in keys {
        any = true;
        h.write(p.kind.as_str().as_bytes());
        h.write_u8(0);
        h.write(p.namespace.as_deref().unwrap_or("").as_bytes());
        h.write_u8(0);
        h.write(p.name.as_bytes());
        h.write_u8(b'\n');
    }
    if !any {
        return 0;
    }
    let x = h.finish();
    finish((x ^ (x >> 32)) as u32)
}

/// Every cookie the agent has written, resolvable by the event reader.
///
/// Bounded: the cookies no endpoint's map holds any more are swept (`sweep`), but only after
/// they were missing at two sweeps in a row (an event may arrive after the entry that made it
/// is gone: the grace is a sweep interval at least). Policy authors drive what the jar holds
/// (each distinct rule set and set of isolating policies is a cookie): a controller that
/// churns policy names would otherwise grow every agent's memory for as long as it runs.
#[derive(Debug, Default)]
pub struct CookieJar {
    cookies: DashMap<Cookie, Kept>,
    /// Advanced by `begin_sweep`: what was registered or touched since is kept by that sweep.
    generation: AtomicU64,
    /// The policy references the jar holds (its size: an isolation cookie names every
    /// isolating policy, a thousand cluster-wide ones for some).
    refs: AtomicUsize,
    /// `refs` after the last sweep.
    swept_refs: AtomicUsize,
}

#[derive(Debug)]
struct Kept {
    attribution: Arc<Attribution>,
    /// The generation it was last registered or touched at.
    stamp: AtomicU64,
    /// Sweeps in a row it was missing at.
    missed: u8,
}

/// What a sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Swept {
    pub removed: usize,
    pub kept: usize,
    /// Cookies in use that the jar cannot resolve (always 0: every cookie is registered
    /// before a map holds it; else the datapath reports verdicts nobody can attribute).
    pub unknown: usize,
}

/// References the jar may gain past twice those it kept at the last sweep before `wants_sweep`
/// says so: a sweep costs a walk of every endpoint's table, paid for by the growth it undoes.
pub const SWEEP_SLACK_REFS: usize = 65_536;

impl CookieJar {
    /// Records what `cookie` stands for (the first revision it was realized at is kept).
    pub fn register(
        &self,
        cookie: Cookie,
        match_kind: MatchKind,
        policies: Vec<PolicyRef>,
        revision: u64,
    ) {
        if cookie == 0 || self.touch(cookie) {
            return;
        }
        let n = policies.len();
        let generation = self.generation.load(Ordering::Acquire);
        if let dashmap::mapref::entry::Entry::Vacant(v) = self.cookies.entry(cookie) {
            v.insert(Kept {
                attribution: Arc::new(Attribution {
                    match_kind,
                    policies,
                    revision,
                }),
                stamp: AtomicU64::new(generation),
                missed: 0,
            });
            self.refs.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// `cookie` is registered (0, no attribution, always is); it is kept by a sweep that
    /// begins before this call even if no map holds it yet (an endpoint is about to write it).
    pub fn touch(&self, cookie: Cookie) -> bool {
        if cookie == 0 {
            return true;
        }
        match self.cookies.get(&cookie) {
            Some(k) => {
                // Written once per generation: a thousand endpoints touch the same cookies
                // from two threads, and a write each time would bounce its line between them.
                let generation = self.generation.load(Ordering::Acquire);
                if k.stamp.load(Ordering::Relaxed) < generation {
                    k.stamp.fetch_max(generation, Ordering::AcqRel);
                }
                true
            }
            None => false,
        }
    }

    /// `cookie` is registered (0, no attribution, always is).
    pub fn knows(&self, cookie: Cookie) -> bool {
        cookie == 0 || self.cookies.contains_key(&cookie)
    }

    pub fn resolve(&self, cookie: Cookie) -> Option<Arc<Attribution>> {
        (cookie != 0)
            .then(|| self.cookies.get(&cookie).map(|k| k.attribution.clone()))
            .flatten()
    }

    pub fn len(&self) -> usize {
        self.cookies.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cookies.is_empty()
    }

    /// Every cookie and what it stands for (tests, debugging).
    pub fn attributions(&self) -> Vec<(Cookie, Arc<Attribution>)> {
        let mut v: Vec<_> = self
            .cookies
            .iter()
            .map(|e| (*e.key(), e.attribution.clone()))
            .collect();
        v.sort_by_key(|(c, _)| *c);
        v
    }

    /// The policy references held.
    pub fn refs(&self) -> usize {
        self.refs.load(Ordering::Relaxed)
    }

    /// The jar has grown enough since the last sweep for one to pay.
    pub fn wants_sweep(&self) -> bool {
        self.refs() >= 2 * self.swept_refs.load(Ordering::Relaxed) + SWEEP_SLACK_REFS
    }

    /// Starts a sweep: call before gathering the cookies in use, and hand the result to
    /// `sweep` (what is registered or touched from now on is kept by it).
    pub fn begin_sweep(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Removes the cookies that neither `in_use` holds nor anyone registered or touched since
    /// `begin_sweep` returned `generation`, at this sweep and the one before.
    pub fn sweep(&self, generation: u64, in_use: &std::collections::HashSet<Cookie>) -> Swept {
        let mut out = Swept::default();
        let mut dropped = 0;
        self.cookies.retain(|c, k| {
            if in_use.contains(c) || k.stamp.load(Ordering::Acquire) >= generation {
                k.missed = 0;
            } else {
                k.missed = k.missed.saturating_add(1);
            }
            let keep = k.missed < 2;
            if keep {
                out.kept += 1;
            } else {
                out.removed += 1;
                dropped += k.attribution.policies.len();
            }
            keep
        });
        let left = self.refs.fetch_sub(dropped, Ordering::Relaxed) - dropped;
        self.swept_refs.store(left, Ordering::Relaxed);
        out.unknown = in_use.iter().filter(|c| !self.knows(**c)).count();
        out
    }
}

/// Verdicts each policy decided (from the attributed verdict events): connections forwarded
/// (the first packet of each new one), packets dropped, would-be drops audited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Hits {
    pub forwarded: u64,
    pub dropped: u64,
    pub audit: u64,
}

/// [`Hits`] by policy (`kind`, `namespace`, `name`).
#[derive(Debug, Default)]
pub struct PolicyHits {
    hits: DashMap<(String, Option<String>, String), Hits>,
}

impl PolicyHits {
    /// Counts one verdict (`forwarded`, `dropped` or `audit`) for every policy it names.
    pub fn record(&self, policies: &[PolicyRef], verdict: &str) {
        for p in policies {
            let mut h = self
                .hits
                .entry((p.kind.clone(), p.namespace.clone(), p.name.clone()))
                .or_default();
            match verdict {
                "forwarded" => h.forwarded += 1,
                "dropped" => h.dropped += 1,
                "audit" => h.audit += 1,
                _ => {}
            }
        }
    }

    /// Policies with hits.
    pub fn len(&self) -> usize {
        self.hits.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hits.is_empty()
    }

    /// Keeps the hits of the policies `known` names (`kind`, `namespace`, `name`); returns how
    /// many went. A deleted policy's hits would otherwise stay for the agent's lifetime (and
    /// its entries report verdicts until every endpoint realized the deletion, so forgetting
    /// them as it goes would not do).
    pub fn retain(&self, known: impl Fn(&str, Option<&str>, &str) -> bool) -> usize {
        let before = self.hits.len();
        self.hits
            .retain(|(kind, ns, name), _| known(kind, ns.as_deref(), name));
        before - self.hits.len()
    }

    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Hits {
        self.hits
            .get(&(
                kind.to_string(),
                namespace.map(str::to_string),
                name.to_string(),
            ))
            .map(|h| *h)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rule::Section;

    fn origin(kind: PolicyKind, ns: Option<&str>, name: &str, path: &str) -> Arc<RuleOrigin> {
        Arc::new(RuleOrigin {
            policy: Arc::new(PolicyKey::new(kind, ns, name)),
            section: Section::Ingress,
            path: path.into(),
            l7: false,
            tier: None,
        })
    }

    use crate::policy::mapstate::ingress_key as key;

    #[test]
    fn flows_name_the_tier_of_the_rule_not_of_the_kind() {
        let baseline = Arc::new(RuleOrigin {
            tier: Some(crate::policy::rule::Tier::Baseline),
            ..(*origin(
                PolicyKind::ClusterNetworkPolicy,
                None,
                "b",
                "spec.ingress[2]",
            ))
            .clone()
        });
        let np = origin(
            PolicyKind::NetworkPolicy,
            Some("x"),
            "np",
            "spec.ingress[0]",
        );
        let (_, refs) = entry_cookie(&[baseline, np], MatchKind::L3Only);
        let tiers: Vec<(&str, PolicyTier)> =
            refs.iter().map(|r| (r.name.as_str(), r.tier)).collect();
        assert_eq!(
            tiers,
            vec![
                ("np", PolicyTier::NetworkPolicy),
                ("b", PolicyTier::Baseline)
            ]
        );
        let json = serde_json::to_value(&refs[1]).unwrap();
        assert_eq!(json["tier"], "baseline", "{json}");
        assert_eq!(json["rule"], 2, "{json}");
    }

    fn refs(n: usize) -> Vec<PolicyRef> {
        let o = origin(PolicyKind::NetworkPolicy, Some("x"), "p", "spec.ingress[0]");
        vec![entry_cookie(std::slice::from_ref(&o), MatchKind::L3Only).1[0].clone(); n]
    }

    #[test]
    fn a_sweep_removes_a_cookie_only_once_two_sweeps_in_a_row_found_it_unused() {
        let jar = CookieJar::default();
        for c in [1, 2, 3, 4] {
            jar.register(c, MatchKind::L3L4, refs(2), 1);
        }
        assert_eq!(jar.refs(), 8);
        let in_use: std::collections::HashSet<Cookie> = [1].into();
        // 4 is about to be written by an endpoint: touched after the sweep began.
        let g = jar.begin_sweep();
        assert!(jar.touch(4));
        assert!(!jar.touch(5), "an unknown cookie is not made up");
        assert_eq!(
            jar.sweep(g, &in_use),
            Swept {
                removed: 0,
                kept: 4,
                unknown: 0
            }
        );
        assert!(
            jar.resolve(2).is_some(),
            "one miss is the grace of late events"
        );
        // 3 is written again (in use at the second sweep): its miss is forgotten.
        let in_use: std::collections::HashSet<Cookie> = [1, 3].into();
        let g = jar.begin_sweep();
        assert_eq!(
            jar.sweep(g, &in_use),
            Swept {
                removed: 1,
                kept: 3,
                unknown: 0
            }
        );
        assert!(jar.resolve(2).is_none(), "missed twice in a row");
        assert!(
            jar.resolve(4).is_some(),
            "touched since the first sweep began"
        );
        assert_eq!(jar.refs(), 6);
        // 4 was never written after all: missed at the second sweep and the third.
        let g = jar.begin_sweep();
        assert_eq!(
            jar.sweep(g, &[1].into()),
            Swept {
                removed: 1,
                kept: 2,
                unknown: 0
            }
        );
        assert!(jar.resolve(4).is_none());
        let g = jar.begin_sweep();
        let swept = jar.sweep(g, &[1, 9].into());
        assert_eq!(
            swept,
            Swept {
                removed: 1,
                kept: 1,
                unknown: 1
            },
            "9 was never registered"
        );
        assert_eq!(jar.refs(), 2);
        assert!(jar.resolve(1).is_some(), "in use all along");
        // Registering again what was swept makes it resolvable again.
        jar.register(2, MatchKind::L3L4, refs(1), 9);
        assert_eq!(jar.resolve(2).map(|a| a.revision), Some(9));
    }

    #[test]
    fn hits_of_policies_no_longer_known_are_forgotten() {
        let hits = PolicyHits::default();
        let (_, a) = entry_cookie(
            &[origin(
                PolicyKind::NetworkPolicy,
                Some("x"),
                "a",
                "spec.ingress[0]",
            )],
            MatchKind::L3Only,
        );
        let (_, b) = entry_cookie(
            &[origin(
                PolicyKind::CiliumNetworkPolicy,
                Some("x"),
                "a",
                "spec.ingress[0]",
            )],
            MatchKind::L3Only,
        );
        hits.record(&a, "forwarded");
        hits.record(&b, "dropped");
        let removed = hits.retain(|kind, ns, name| {
            kind == "CiliumNetworkPolicy" && ns == Some("x") && name == "a"
        });
        assert_eq!(removed, 1);
        assert_eq!(hits.get("NetworkPolicy", Some("x"), "a"), Hits::default());
        assert_eq!(hits.get("CiliumNetworkPolicy", Some("x"), "a").dropped, 1);
    }

    #[test]
    fn the_jar_asks_for_a_sweep_when_it_has_doubled_past_the_slack() {
        let jar = CookieJar::default();
        jar.register(1, MatchKind::DefaultDeny, refs(SWEEP_SLACK_REFS - 1), 1);
        assert!(!jar.wants_sweep());
        jar.register(2, MatchKind::L3L4, refs(1), 1);
        assert!(jar.wants_sweep());
        let g = jar.begin_sweep();
        jar.sweep(g, &[1, 2].into());
        assert!(
            !jar.wants_sweep(),
            "what is in use does not count as growth"
        );
        jar.register(3, MatchKind::L3L4, refs(SWEEP_SLACK_REFS), 1);
        assert!(!jar.wants_sweep(), "twice what was kept, plus the slack");
        jar.register(4, MatchKind::L3L4, refs(SWEEP_SLACK_REFS), 1);
        assert!(jar.wants_sweep());
    }

    #[test]
    fn monitor_and_simulate_name_a_rule_the_same_way() {
        for (kind, ns, name, path, want) in [
            (
                PolicyKind::CiliumNetworkPolicy,
                Some("x"),
                "a",
                "specs[1].egressDeny[2]",
                "CiliumNetworkPolicy x/a[2]",
            ),
            (
                PolicyKind::CiliumClusterwideNetworkPolicy,
                None,
                "c",
                "spec.ingress[0]",
                "CiliumClusterwideNetworkPolicy c[0]",
            ),
        ] {
            let o = origin(kind, ns, name, path);
            let (_, refs) = entry_cookie(std::slice::from_ref(&o), MatchKind::L3Only);
            assert_eq!(refs[0].named(), want, "what ciliate monitor prints");
            assert_eq!(o.describe(), want, "what policy simulate prints");
        }
    }

    #[test]
    fn cookies_are_stable_order_free_and_differ_by_rule_and_match() {
        let a = origin(
            PolicyKind::CiliumNetworkPolicy,
            Some("x"),
            "a",
            "spec.ingress[1]",
        );
        let b = origin(PolicyKind::NetworkPolicy, Some("x"), "b", "spec.ingress[0]");
        let (c1, refs) = entry_cookie(&[a.clone(), b.clone()], MatchKind::L3L4);
        let (c2, _) = entry_cookie(&[b.clone(), a.clone()], MatchKind::L3L4);
        assert_eq!(c1, c2, "the order of origins does not matter");
        assert_ne!(c1, 0);
        assert_eq!(
            refs.iter().map(PolicyRef::short).collect::<Vec<_>>(),
            ["x/b[0]", "x/a[1]"],
            "sorted by kind, then name"
        );
        assert_ne!(
            entry_cookie(std::slice::from_ref(&a), MatchKind::L3L4).0,
            c1
        );
        assert_ne!(
            entry_cookie(std::slice::from_ref(&a), MatchKind::L3Only).0,
            entry_cookie(std::slice::from_ref(&a), MatchKind::L3L4).0
        );
        let a2 = origin(
            PolicyKind::CiliumNetworkPolicy,
            Some("x"),
            "a",
            "spec.ingress[2]",
        );
        assert_ne!(
            entry_cookie(&[a], MatchKind::L3L4).0,
            entry_cookie(&[a2], MatchKind::L3L4).0
        );
    }

    #[test]
    fn match_kinds_follow_the_entry() {
        for (k, deny, want) in [
            (key(300, 6, 80, 80), false, MatchKind::L3L4),
            (key(300, 0, 0, 65535), false, MatchKind::L3Only),
            (key(300, 6, 0, 65535), false, MatchKind::L3Only),
            (key(0, 17, 53, 53), false, MatchKind::L4Only),
            (key(0, 0, 0, 65535), false, MatchKind::All),
            (key(300, 6, 80, 80), true, MatchKind::DenyRule),
        ] {
            assert_eq!(MatchKind::of_entry(&k, deny), want, "{k:?} deny {deny}");
        }
    }

    #[test]
    fn isolation_cookies_name_the_policies_and_the_jar_resolves_them() {
        let p = Arc::new(PolicyKey::new(
            PolicyKind::NetworkPolicy,
            Some("x"),
            "deny-all",
        ));
        let q = Arc::new(PolicyKey::new(
            PolicyKind::CiliumClusterwideNetworkPolicy,
            None,
            "base",
        ));
        assert_eq!(isolation_cookie(&[]).0, 0);
        let (c, refs) = isolation_cookie(&[p.clone(), q.clone()]);
        assert_eq!(c, isolation_cookie(&[q.clone(), p.clone()]).0);
        assert_eq!(
            c,
            isolation_cookie_value(&[q.clone(), p.clone(), q.clone()])
        );
        assert_eq!(c, isolation_cookie_value(&[p, q]));
        assert_eq!(isolation_cookie_value(&[]), 0);
        let jar = CookieJar::default();
        jar.register(c, MatchKind::DefaultDeny, refs.clone(), 7);
        jar.register(c, MatchKind::DefaultDeny, vec![], 9);
        let a = jar.resolve(c).expect("registered");
        assert_eq!(
            (a.match_kind, a.revision),
            (MatchKind::DefaultDeny, 7),
            "first registration kept"
        );
        assert_eq!(a.policies, refs);
        assert!(refs
            .iter()
            .any(|r| r.namespace.is_none() && r.name == "base"));
        assert!(jar.resolve(0).is_none());
        assert!(jar.resolve(c ^ 1).is_none());
        let hits = PolicyHits::default();
        hits.record(&refs, "dropped");
        hits.record(&refs, "dropped");
        let base: Vec<PolicyRef> = refs.iter().filter(|r| r.name == "base").cloned().collect();
        hits.record(&base, "forwarded");
        let h = hits.get("NetworkPolicy", Some("x"), "deny-all");
        assert_eq!((h.forwarded, h.dropped, h.audit), (0, 2, 0));
        assert_eq!(
            hits.get("CiliumClusterwideNetworkPolicy", None, "base")
                .forwarded,
            1
        );
    }
}
