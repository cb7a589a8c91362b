//! The running agent's composition root: configuration, start-up (`run.rs`, the only place
//! that wires actors, API, datapath and watchers together) and the listening sockets. The
//! shared services it hands out live in `crate::runtime`, the actors in `crate::actors`, the
//! endpoint state and restore in `crate::endpoint`.

pub mod dns;
pub mod history;
pub mod l7;
pub mod listen;
pub mod proxies;
pub mod run;
