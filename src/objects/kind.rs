//! The kinds of object the agent watches, in the order a batch of them is applied: identities
//! exist before the rules that select them (namespaces, nodes, services and pods before
//! policies); deletes go the other way.

/// A watched kind. The variant order is the apply order.
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
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::Namespace,
        Kind::Node,
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Pod,
        Kind::NetworkPolicy,
        Kind::CiliumNetworkPolicy,
        Kind::CiliumClusterwideNetworkPolicy,
    ];

    /// The kind as manifests and the API server spell it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Node => "Node",
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Pod => "Pod",
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::CiliumNetworkPolicy => "CiliumNetworkPolicy",
            Kind::CiliumClusterwideNetworkPolicy => "CiliumClusterwideNetworkPolicy",
        }
    }

    /// `None` for kinds the agent has no use for.
    pub fn parse(kind: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == kind)
    }

    pub fn is_policy(self) -> bool {
        self >= Kind::NetworkPolicy
    }

    pub fn cluster_scoped(self) -> bool {
        matches!(
            self,
            Kind::Namespace | Kind::Node | Kind::CiliumClusterwideNetworkPolicy
        )
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Kind;

    #[test]
    fn kinds_parse_back_and_sort_in_apply_order() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.name()), Some(k));
        }
        assert_eq!(Kind::parse("ConfigMap"), None);
        let mut sorted = Kind::ALL;
        sorted.sort();
        assert_eq!(sorted, Kind::ALL);
        assert!(Kind::Pod < Kind::NetworkPolicy && Kind::Namespace < Kind::Pod);
        assert!(Kind::CiliumNetworkPolicy.is_policy() && !Kind::Pod.is_policy());
    }
}
