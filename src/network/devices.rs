//! The node's native devices (Cilium's `--devices`): the host firewall's programs go on each of
//! them, and their addresses are the node's own (identity `host` in the ipcache, as Cilium's
//! node addresses are), besides the addresses the Node object lists.
//!
//! `--devices` names them (a name, or a prefix ending in `+`: `eth+`); without it, every
//! device of the agent's network namespace that holds a global address is one, as Cilium
//! detects them. Never a device: loopback, pods' veths (`lxc...`), the agent's own devices
//! (`ciliate_...`) and the other prefixes Cilium leaves out (`cilium_`, `cni`, `docker`).
//! `select` is pure; `read` is the thin part that asks the kernel.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// Name prefixes that are never a native device.
const NEVER: &[&str] = &["lxc", "ciliate_", "cilium_", "cni", "docker"];

/// `--devices`: which of the namespace's devices are native.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceSelector {
    /// The devices that hold a global address.
    #[default]
    Detect,
    /// These names; one ending in `+` is a prefix.
    Named(Vec<String>),
}

impl DeviceSelector {
    /// From `--devices` (given once per device, or comma-separated); none given: `Detect`.
    pub fn parse(values: &[String]) -> Result<Self, String> {
        let names: Vec<String> = values
            .iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if names.is_empty() {
            return Ok(DeviceSelector::Detect);
        }
        for n in &names {
            let bare = n.strip_suffix('+').unwrap_or(n);
            if bare.is_empty() || bare.len() > 15 || bare.contains(['/', '+', ' ', ':']) {
                return Err(format!(
                    "--devices: {n:?} is no device name (up to 15 characters, no '/', ':' or \
                     spaces; a trailing '+' makes it a prefix)"
                ));
            }
        }
        Ok(DeviceSelector::Named(names))
    }

    fn wants(&self, d: &Device) -> bool {
        match self {
            DeviceSelector::Detect => d.addrs.iter().any(|a| is_global(*a)),
            DeviceSelector::Named(names) => names.iter().any(|n| match n.strip_suffix('+') {
                Some(prefix) => d.name.starts_with(prefix),
                None => d.name == *n,
            }),
        }
    }

    /// The names `--devices` gives that match none of `devices` (a device that is not there).
    pub fn missing(&self, devices: &[Device]) -> Vec<String> {
        match self {
            DeviceSelector::Detect => Vec::new(),
            DeviceSelector::Named(names) => names
                .iter()
                .filter(|n| !n.ends_with('+') && !devices.iter().any(|d| &d.name == *n))
                .cloned()
                .collect(),
        }
    }
}

/// One device of the agent's network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub ifindex: u32,
    pub loopback: bool,
    /// Its addresses, both families.
    pub addrs: Vec<IpAddr>,
}

/// Whether `a` is an address the node is reached at from elsewhere: neither loopback,
/// link-local, multicast nor unspecified.
fn is_global(a: IpAddr) -> bool {
    crate::objects::addresses::not_a_pod_address(a).is_none()
}

/// The native devices among `all`, by name.
pub fn select(all: &[Device], selector: &DeviceSelector) -> Vec<Device> {
    let mut out: Vec<Device> = all
        .iter()
        .filter(|d| !d.loopback && !NEVER.iter().any(|p| d.name.starts_with(p)))
        .filter(|d| selector.wants(d))
        .cloned()
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The node's own addresses on `devices`: identity `host`.
pub fn host_addresses(devices: &[Device]) -> BTreeSet<IpAddr> {
    devices
        .iter()
        .flat_map(|d| d.addrs.iter().copied())
        .filter(|a| is_global(*a))
        .collect()
}

/// Every device of this network namespace, with its addresses.
pub fn read() -> Result<Vec<Device>, String> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| format!("list devices: {e}"))?;
    let mut by_name: BTreeMap<String, Device> = BTreeMap::new();
    for a in addrs {
        let name = a.interface_name.clone();
        if !by_name.contains_key(&name) {
            let Ok(ifindex) = nix::net::if_::if_nametoindex(name.as_str()) else {
                continue; // gone meanwhile
            };
            let loopback = a
                .flags
                .contains(nix::net::if_::InterfaceFlags::IFF_LOOPBACK);
            let d = Device {
                name: name.clone(),
                ifindex,
                loopback,
                addrs: Vec::new(),
            };
            by_name.insert(name.clone(), d);
        }
        let ip = a.address.as_ref().and_then(|s| {
            s.as_sockaddr_in()
                .map(|v| IpAddr::V4(v.ip()))
                .or_else(|| s.as_sockaddr_in6().map(|v| IpAddr::V6(v.ip())))
        });
        if let (Some(ip), Some(d)) = (ip, by_name.get_mut(&name)) {
            d.addrs.push(ip);
        }
    }
    Ok(by_name.into_values().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, ifindex: u32, addrs: &[&str]) -> Device {
        Device {
            name: name.into(),
            ifindex,
            loopback: name == "lo",
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    fn names(ds: &[Device]) -> Vec<&str> {
        ds.iter().map(|d| d.name.as_str()).collect()
    }

    fn node() -> Vec<Device> {
        vec![
            dev("lo", 1, &["127.0.0.1", "::1"]),
            dev("eth1", 3, &["10.99.0.1", "fe80::1"]),
            dev("eth0", 2, &["172.20.0.11", "fe80::2"]),
            dev("eth2", 4, &["fe80::3"]),
            dev("lxc1a2b", 5, &["fe80::4"]),
            dev("ciliate_vxlan", 6, &[]),
            dev("cilium_host", 7, &["10.0.0.1"]),
            dev("docker0", 8, &["172.17.0.1"]),
            dev("eth3", 9, &["2001:db8::1"]),
        ]
    }

    #[test]
    fn detected_devices_are_those_with_a_global_address_never_loopback_pods_or_agents() {
        let got = select(&node(), &DeviceSelector::Detect);
        assert_eq!(names(&got), ["eth0", "eth1", "eth3"]);
        let addrs: Vec<String> = host_addresses(&got).iter().map(|a| a.to_string()).collect();
        assert_eq!(addrs, ["10.99.0.1", "172.20.0.11", "2001:db8::1"]);
    }

    #[test]
    fn named_devices_and_prefixes_select_also_devices_without_an_address() {
        let s = DeviceSelector::parse(&["eth0".into(), "eth2,eth9".into()]).unwrap();
        assert_eq!(names(&select(&node(), &s)), ["eth0", "eth2"]);
        assert_eq!(s.missing(&node()), ["eth9"]);
        let s = DeviceSelector::parse(&["eth+".into()]).unwrap();
        assert_eq!(
            names(&select(&node(), &s)),
            ["eth0", "eth1", "eth2", "eth3"]
        );
        assert!(s.missing(&node()).is_empty());
        // Naming them never makes a pod's veth or loopback a native device.
        let s = DeviceSelector::parse(&["lxc+,lo,ciliate_vxlan".into()]).unwrap();
        assert!(select(&node(), &s).is_empty());
        assert_eq!(DeviceSelector::parse(&[]).unwrap(), DeviceSelector::Detect);
    }

    #[test]
    fn a_bad_device_name_is_refused_with_the_flag() {
        for bad in ["+", "a/b", "eth0+x", "abcdefghijklmnopq", "eth 0"] {
            let e = DeviceSelector::parse(&[bad.into()]).unwrap_err();
            assert!(e.starts_with("--devices:"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_namespace_has_loopback_with_its_address() {
        let all = read().unwrap();
        let lo = all.iter().find(|d| d.loopback).expect("loopback");
        assert!(lo.addrs.contains(&"127.0.0.1".parse().unwrap()));
        assert!(select(&all, &DeviceSelector::Detect)
            .iter()
            .all(|d| !d.loopback));
    }
}
