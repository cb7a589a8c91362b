//! HTTP probes (`http:` in a probe, interfaces.md section 11). Once L3/L4 policy allowed the
//! connection both ways, each side whose allowing entries carry HTTP rules judges the request
//! as the HTTP proxy would: every allowing contribution for that peer and port counts, and one
//! without HTTP rules lets every request through.

use std::collections::HashMap;
use std::sync::Arc;

use crate::policy::engine::EndpointPolicy;
use crate::policy::identity::NumericIdentity;
use crate::policy::l7::http::{
    judge, normalize_target, CompiledRules, Grant, HttpVerdict, L7PortRules, RequestView,
};
use crate::policy::rule::Direction;

use super::world::HttpProbe;

/// The allowing contributions one side judges a request by: (rule, its L7 part), or `None`
/// when no entry for that peer and port goes to the proxy (no HTTP rules apply on this side).
pub fn side_grants(
    pol: &EndpointPolicy,
    d: Direction,
    peer: NumericIdentity,
    protocol: u8,
    port: u16,
) -> Option<Vec<(String, Option<Arc<L7PortRules>>)>> {
    let entries = pol.map.allows(d, peer, protocol, port)?;
    if !entries.iter().any(|e| e.redirect()) {
        return None;
    }
    let mut out = Vec::new();
    for e in entries {
        match &e.l7 {
            Some(grants) => out.extend(
                grants
                    .iter()
                    .map(|g| (g.origin.describe(), g.rules.clone())),
            ),
            None => out.extend(e.derived_from.iter().map(|o| (o.describe(), None))),
        }
    }
    Some(out)
}

/// A probe's request, as the proxy would see it.
pub struct Request {
    pub method: String,
    pub path: String,
    pub host: String,
    pub headers: Vec<(String, String)>,
}

impl Request {
    /// The probe's request with its defaults; the path normalised (an error when the proxy
    /// would answer 400).
    pub fn of(probe: &HttpProbe, default_host: String) -> Result<Request, String> {
        let path = probe.path.clone().unwrap_or_else(|| "/".into());
        let target =
            normalize_target(&path).map_err(|e| format!("the path {path:?}: {e} (400)"))?;
        Ok(Request {
            method: probe.method.clone().unwrap_or_else(|| "GET".into()),
            path: target.path_and_query,
            host: target
                .authority
                .or_else(|| probe.host.clone())
                .unwrap_or(default_host),
            headers: probe
                .headers
                .iter()
                .flatten()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
                .collect(),
        })
    }
}

/// Compiled rules, once per rule set.
#[derive(Default)]
pub struct Compiled(HashMap<usize, CompiledRules>);

impl Compiled {
    /// Judges `req` by one side's grants.
    pub fn judge(
        &mut self,
        grants: &[(String, Option<Arc<L7PortRules>>)],
        req: &Request,
    ) -> HttpVerdict {
        for (_, rules) in grants {
            if let Some(r) = rules {
                let key = Arc::as_ptr(r) as usize;
                if let std::collections::hash_map::Entry::Vacant(v) = self.0.entry(key) {
                    // Translation compiled every regex already: this cannot fail.
                    if let Ok(c) = CompiledRules::compile(r.clone()) {
                        v.insert(c);
                    }
                }
            }
        }
        let g: Vec<Grant> = grants
            .iter()
            .map(|(rule, rules)| Grant {
                rule: rule.as_str(),
                rules: rules
                    .as_ref()
                    .and_then(|r| self.0.get(&(Arc::as_ptr(r) as usize))),
            })
            .collect();
        let view = RequestView {
            method: &req.method,
            path: &req.path,
            host: &req.host,
            headers: &req.headers,
        };
        judge(&g, &view)
    }
}

/// The rules that would judge requests, for a probe without `http:`.
pub fn rules_named(grants: &[(String, Option<Arc<L7PortRules>>)]) -> String {
    let mut names: Vec<&str> = grants
        .iter()
        .filter(|(_, r)| r.is_some())
        .map(|(n, _)| n.as_str())
        .collect();
    names.dedup();
    names.join(", ")
}
