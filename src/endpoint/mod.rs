//! Endpoints at rest: the state directory (one record per endpoint, written atomically, with
//! the CNI plugin's intent records) and the pure restore decisions taken at start-up.

pub mod restore;
pub mod state;
