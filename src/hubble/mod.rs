//! Hubble's API (interfaces.md section 15): the agent's flows served as Cilium's
//! `observer.Observer` and `peer.Peer` gRPC services, wire-compatible with Cilium's `api/v1`
//! packages, so that the hubble CLI, Hubble Relay and Hubble UI read a ciliate node unchanged.
//!
//! - `proto`: the messages and both sides of the services, generated at build time from
//!   `proto/` (this project's copy of the packages, with Cilium's names and field numbers).
//! - `convert`: a flow record (`datapath::events::VerdictEvent`, the one record `ciliate
//!   monitor` shows too, so the two never disagree) as Hubble's `flow.Flow`, and the names
//!   Hubble's metrics label it with.
//! - `filter`: Hubble's flow filters (`whitelist`, `blacklist`), compiled once per request.
//! - `wire`: a flow's `GetFlowsResponse` as protobuf bytes, with what recurs across a call's
//!   flows (endpoints, names, policies) encoded once per call.
//! - `server`: the services over the agent's flow ring, its identities and its Node objects.
//! - `relay`: `ciliate relay`, the Observer API for the whole cluster, from every agent the
//!   Peer service names.
//!
//! Trust: the Observer shows every flow of the node, with pod names and labels. The unix socket
//! (`STATE_DIR/hubble.sock`) is the agent user's alone (0600); the TCP listener exists only when
//! the operator names an address (`--hubble-listen-address`), with TLS when certificate files are
//! given and plain text otherwise, as Cilium's flags do. Nothing a client sends changes the
//! agent's state: every call is a read, and a request's filters are bounded in size.

pub mod convert;
pub mod filter;
pub mod relay;
pub mod server;
pub mod wire;

/// The generated code of each package.
pub mod proto {
    #![allow(clippy::all, missing_docs, clippy::pedantic)]
    pub mod flow {
        tonic::include_proto!("flow");
    }
    pub mod relay {
        tonic::include_proto!("relay");
    }
    pub mod peer {
        tonic::include_proto!("peer");
    }
    pub mod observer {
        tonic::include_proto!("observer");
    }
}

/// The port of Hubble's TCP listener when none is named (Cilium's).
pub const DEFAULT_PORT: u16 = 4244;

/// The socket's file name in the state directory.
pub const SOCKET_NAME: &str = "hubble.sock";
