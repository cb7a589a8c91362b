//! Helpers shared by the integration tests (each test binary uses a part of them).
#![allow(dead_code)]

pub mod agent;
pub mod cni;
pub mod netns;
