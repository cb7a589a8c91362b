//! Every kind of object the agent reads, in one table (`KINDS`): its name, API group and
//! version, plural, scope, and for policy kinds which family of policy it is and whether the
//! agent writes its status. The manifest directory, both watchers, `objects::Kind`,
//! `PolicyKind`, policy translation and the CRD list all read it, so a new kind is one row here
//! (plus its translation).
//!
//! A leaf module: it depends on nothing else of the crate.

/// A kind the agent reads. The variant order is the apply order: identities exist before the
/// rules that select them (namespaces, nodes, services and pods before policies); deletes go
/// the other way. `KINDS` has one row per variant, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Namespace,
    Node,
    Service,
    EndpointSlice,
    Pod,
    NetworkPolicy,
    CiliumNetworkPolicy,
    CiliumClusterwideNetworkPolicy,
    AdminNetworkPolicy,
    BaselineAdminNetworkPolicy,
    ClusterNetworkPolicy,
}

/// The policy kinds, and the agent's own rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    NetworkPolicy,
    CiliumNetworkPolicy,
    CiliumClusterwideNetworkPolicy,
    AdminNetworkPolicy,
    BaselineAdminNetworkPolicy,
    ClusterNetworkPolicy,
    /// Behaviour the agent adds on its own (e.g. allow-localhost); never parsed from input.
    Builtin,
}

/// Which wire types and translation a policy kind has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `networking.k8s.io/v1` NetworkPolicy.
    Kubernetes,
    /// `cilium.io/v2` CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy.
    Cilium,
    /// `policy.networking.k8s.io`: AdminNetworkPolicy and BaselineAdminNetworkPolicy
    /// (`v1alpha1`), ClusterNetworkPolicy (`v1alpha2`): the cluster tiers.
    NetworkPolicyApi,
}

/// One kind's row.
#[derive(Debug, Clone, Copy)]
pub struct KindInfo {
    pub kind: Kind,
    /// As manifests and the API server spell it.
    pub name: &'static str,
    /// `""`: the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub cluster_scoped: bool,
    /// For policy kinds: which one, and its family.
    pub policy: Option<(PolicyKind, Family)>,
    /// The agent writes each object's status (conditions, per node).
    pub status: bool,
    /// `manifests/crds/` has its CustomResourceDefinition (`k8s::crd::crds`).
    pub crd: bool,
    /// The Kubernetes watcher watches it (the initial sync waits for its first list).
    pub watched: bool,
    /// Served only where its CRD is installed (the network-policy-api's, which a cluster may
    /// not have): while the API server answers 404 the kind holds no objects and the initial
    /// sync does not wait for it; the watch keeps retrying and picks the kind up once the CRD
    /// appears. Any other error still holds the sync (fail closed).
    pub optional: bool,
}

impl KindInfo {
    /// `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

const fn row(
    kind: Kind,
    name: &'static str,
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    cluster_scoped: bool,
) -> KindInfo {
    KindInfo {
        kind,
        name,
        group,
        version,
        plural,
        cluster_scoped,
        policy: None,
        status: false,
        crd: false,
        watched: true,
        optional: false,
    }
}

/// A policy kind; `custom`: a custom resource whose status the agent writes.
const fn policy(mut r: KindInfo, p: PolicyKind, family: Family, custom: bool) -> KindInfo {
    r.policy = Some((p, family));
    r.status = custom;
    r.crd = custom;
    r
}

/// A kind served only where its CRD is installed (`optional`).
const fn optional(mut r: KindInfo) -> KindInfo {
    r.optional = true;
    r
}

/// Every kind, in apply order (the order of `Kind`'s variants).
pub const KINDS: [KindInfo; 11] = [
    row(Kind::Namespace, "Namespace", "", "v1", "namespaces", true),
    row(Kind::Node, "Node", "", "v1", "nodes", true),
    row(Kind::Service, "Service", "", "v1", "services", false),
    row(
        Kind::EndpointSlice,
        "EndpointSlice",
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        false,
    ),
    row(Kind::Pod, "Pod", "", "v1", "pods", false),
    policy(
        row(
            Kind::NetworkPolicy,
            "NetworkPolicy",
            "networking.k8s.io",
            "v1",
            "networkpolicies",
            false,
        ),
        PolicyKind::NetworkPolicy,
        Family::Kubernetes,
        false,
    ),
    policy(
        row(
            Kind::CiliumNetworkPolicy,
            "CiliumNetworkPolicy",
            "cilium.io",
            "v2",
            "ciliumnetworkpolicies",
            false,
        ),
        PolicyKind::CiliumNetworkPolicy,
        Family::Cilium,
        true,
    ),
    policy(
        row(
            Kind::CiliumClusterwideNetworkPolicy,
            "CiliumClusterwideNetworkPolicy",
            "cilium.io",
            "v2",
            "ciliumclusterwidenetworkpolicies",
            true,
        ),
        PolicyKind::CiliumClusterwideNetworkPolicy,
        Family::Cilium,
        true,
    ),
    optional(policy(
        row(
            Kind::AdminNetworkPolicy,
            "AdminNetworkPolicy",
            "policy.networking.k8s.io",
            "v1alpha1",
            "adminnetworkpolicies",
            true,
        ),
        PolicyKind::AdminNetworkPolicy,
        Family::NetworkPolicyApi,
        true,
    )),
    optional(policy(
        row(
            Kind::BaselineAdminNetworkPolicy,
            "BaselineAdminNetworkPolicy",
            "policy.networking.k8s.io",
            "v1alpha1",
            "baselineadminnetworkpolicies",
            true,
        ),
        PolicyKind::BaselineAdminNetworkPolicy,
        Family::NetworkPolicyApi,
        true,
    )),
    optional(policy(
        row(
            Kind::ClusterNetworkPolicy,
            "ClusterNetworkPolicy",
            "policy.networking.k8s.io",
            "v1alpha2",
            "clusternetworkpolicies",
            true,
        ),
        PolicyKind::ClusterNetworkPolicy,
        Family::NetworkPolicyApi,
        true,
    )),
];

impl Kind {
    pub const ALL: [Kind; 11] = [
        Kind::Namespace,
        Kind::Node,
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Pod,
        Kind::NetworkPolicy,
        Kind::CiliumNetworkPolicy,
        Kind::CiliumClusterwideNetworkPolicy,
        Kind::AdminNetworkPolicy,
        Kind::BaselineAdminNetworkPolicy,
        Kind::ClusterNetworkPolicy,
    ];

    pub fn info(self) -> &'static KindInfo {
        &KINDS[self as usize]
    }

    /// The kind as manifests and the API server spell it.
    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// `None` for kinds the agent has no use for.
    pub fn parse(kind: &str) -> Option<Kind> {
        KINDS.iter().find(|r| r.name == kind).map(|r| r.kind)
    }

    pub fn is_policy(self) -> bool {
        self.info().policy.is_some()
    }

    pub fn cluster_scoped(self) -> bool {
        self.info().cluster_scoped
    }

    /// The policy kinds, in apply order.
    pub fn policies() -> impl Iterator<Item = &'static KindInfo> {
        KINDS.iter().filter(|r| r.policy.is_some())
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl PolicyKind {
    /// The kind (`None` for the agent's own rules). A match, not a search of `KINDS`: verdicts
    /// name policies on the per-event path (a test checks it agrees with the table).
    pub fn kind(self) -> Option<Kind> {
        match self {
            PolicyKind::NetworkPolicy => Some(Kind::NetworkPolicy),
            PolicyKind::CiliumNetworkPolicy => Some(Kind::CiliumNetworkPolicy),
            PolicyKind::CiliumClusterwideNetworkPolicy => {
                Some(Kind::CiliumClusterwideNetworkPolicy)
            }
            PolicyKind::AdminNetworkPolicy => Some(Kind::AdminNetworkPolicy),
            PolicyKind::BaselineAdminNetworkPolicy => Some(Kind::BaselineAdminNetworkPolicy),
            PolicyKind::ClusterNetworkPolicy => Some(Kind::ClusterNetworkPolicy),
            PolicyKind::Builtin => None,
        }
    }

    /// The kind's row (`None` for the agent's own rules).
    pub fn info(self) -> Option<&'static KindInfo> {
        self.kind().map(Kind::info)
    }

    pub fn as_str(&self) -> &'static str {
        self.info().map_or("built-in", |r| r.name)
    }

    pub fn from_kind(kind: &str) -> Option<Self> {
        Kind::parse(kind).and_then(|k| k.info().policy.map(|(p, _)| p))
    }

    pub fn is_namespaced(&self) -> bool {
        self.info().is_some_and(|r| !r.cluster_scoped)
    }

    /// `None` for the agent's own rules.
    pub fn family(self) -> Option<Family> {
        self.info().and_then(|r| r.policy.map(|(_, f)| f))
    }

    /// The agent writes the status of objects of this kind.
    pub fn has_status(self) -> bool {
        self.info().is_some_and(|r| r.status)
    }

    /// "A, B or C": the policy kinds, for error messages.
    pub fn expected() -> String {
        let names: Vec<&str> = Kind::policies().map(|r| r.name).collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            Some((last, _)) => last.to_string(),
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Family, Kind, PolicyKind, KINDS};

    #[test]
    fn one_row_per_kind_in_apply_order() {
        for (i, k) in Kind::ALL.into_iter().enumerate() {
            assert_eq!(KINDS[i].kind, k, "row {i}");
            assert_eq!(Kind::parse(k.name()), Some(k));
        }
        assert_eq!(Kind::parse("ConfigMap"), None);
        let mut sorted = Kind::ALL;
        sorted.sort();
        assert_eq!(sorted, Kind::ALL);
        assert!(Kind::Pod < Kind::NetworkPolicy && Kind::Namespace < Kind::Pod);
        assert!(Kind::CiliumNetworkPolicy.is_policy() && !Kind::Pod.is_policy());
        // Policies come after everything they select.
        let first_policy = Kind::ALL.iter().position(|k| k.is_policy()).unwrap();
        assert!(Kind::ALL[first_policy..].iter().all(|k| k.is_policy()));
    }

    #[test]
    fn policy_kinds_and_rows_agree() {
        for r in KINDS.iter() {
            if let Some((p, _)) = r.policy {
                assert_eq!(p.kind(), Some(r.kind), "{}", r.name);
            }
        }
        assert_eq!(PolicyKind::Builtin.kind(), None);
    }

    #[test]
    fn policy_kinds_read_the_table() {
        assert_eq!(
            PolicyKind::from_kind("CiliumClusterwideNetworkPolicy"),
            Some(PolicyKind::CiliumClusterwideNetworkPolicy)
        );
        assert_eq!(PolicyKind::from_kind("Pod"), None);
        assert_eq!(PolicyKind::from_kind("built-in"), None);
        assert_eq!(PolicyKind::Builtin.as_str(), "built-in");
        assert!(PolicyKind::NetworkPolicy.is_namespaced());
        assert!(!PolicyKind::CiliumClusterwideNetworkPolicy.is_namespaced());
        assert!(!PolicyKind::Builtin.is_namespaced());
        assert_eq!(PolicyKind::NetworkPolicy.family(), Some(Family::Kubernetes));
        assert!(PolicyKind::CiliumNetworkPolicy.has_status());
        assert!(!PolicyKind::NetworkPolicy.has_status());
        assert_eq!(
            PolicyKind::expected(),
            "NetworkPolicy, CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy, AdminNetworkPolicy, BaselineAdminNetworkPolicy or ClusterNetworkPolicy"
        );
        assert_eq!(
            Kind::ClusterNetworkPolicy.info().api_version(),
            "policy.networking.k8s.io/v1alpha2"
        );
        let anp = Kind::AdminNetworkPolicy.info();
        assert!(anp.watched && anp.optional && anp.status && anp.crd);
        assert!(Kind::Pod.info().watched && !Kind::CiliumNetworkPolicy.info().optional);
        assert_eq!(
            Kind::NetworkPolicy.info().api_version(),
            "networking.k8s.io/v1"
        );
        assert_eq!(Kind::Pod.info().api_version(), "v1");
    }
}
