//! Endpoints at rest: the registry of this node's endpoints (admission, ids), the state directory (one record per endpoint, written atomically, with
//! the CNI plugin's intent records), the pure restore decisions taken at start-up, and the
//! regeneration state machine `EndpointActor` runs, the CNI ADD's rollback guard, and the
//! journal of identity numbers (`numbering`), and the host endpoint (`host`).

pub mod cni;
pub mod fanout;
pub mod host;
pub mod numbering;
pub mod regeneration;
pub mod registry;
pub mod restore;
pub mod state;
