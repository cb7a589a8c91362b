//! From a manifest document to validated internal rules.
//!
//! `parse_policy` takes one YAML/JSON document, picks the policy kind, deserialises it with field
//! paths recorded (so a type error says `spec.egress: invalid type: map, expected a sequence`),
//! collects unknown fields as warnings, validates everything `policy-semantics.md` lists, and
//! translates to `Rule`s (namespace scoping, entities, CIDRs, KNP peers). Errors always name the
//! policy (`Kind namespace/name`) and the field path.

mod cilium;
mod common;
mod document;
mod knp;
mod npa;

use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_yaml::Value;

use super::rule::{PolicyKey, PolicyKind, Rule, RuleOrigin, Section, Tier};
use super::services::ServiceTable;
use crate::kinds::Family;

pub use common::{icmp_type_from_name, is_iana_service_name, parse_cidr};
pub use document::Document;

/// A policy that passed validation, ready for the repository.
#[derive(Debug, Clone)]
pub struct ParsedPolicy {
    pub key: Arc<PolicyKey>,
    pub rules: Vec<Rule>,
    /// Unknown fields that were ignored (the API server would prune them).
    pub warnings: Vec<String>,
    /// What ciliate accepts but enforces only partly (L7, FQDN, auth, ...), for status and reasons.
    pub notes: Vec<String>,
    /// The policy has `toServices`: translate it again when services or their backends change.
    pub uses_services: bool,
    /// Staged (`policy.ciliate.io/mode: audit`): loaded and resolved, not enforced.
    pub staged: bool,
}

/// The annotation that stages a policy (interfaces section 16).
pub const MODE_ANNOTATION: &str = "policy.ciliate.io/mode";

/// Whether the policy is staged: `audit` stages it, `enforce` (or no annotation) enforces it;
/// any other value is refused, naming the annotation (a mistyped mode must not enforce or
/// stage silently what its author did not mean).
fn staged_mode(doc: &Value, ctx: &Ctx) -> Result<bool, PolicyError> {
    let field = format!("metadata.annotations[\"{MODE_ANNOTATION}\"]");
    let Some(v) = doc
        .get("metadata")
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get(MODE_ANNOTATION))
    else {
        return Ok(false);
    };
    match v.as_str() {
        Some("audit") => Ok(true),
        Some("enforce") => Ok(false),
        Some(other) => Err(ctx.err(
            &field,
            format!("unknown mode {other:?} (expected \"audit\" or \"enforce\")"),
        )),
        None => Err(ctx.err(&field, "must be a string: \"audit\" or \"enforce\"")),
    }
}

/// Why a policy was rejected: which policy, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{policy}: {field}: {message}")]
pub struct PolicyError {
    /// `Kind namespace/name`, or where the document stands when it has no usable name.
    pub policy: String,
    /// Field path, e.g. `spec.egress[0].toCIDRSet[0].except[1]`.
    pub field: String,
    pub message: String,
}

/// Collects warnings and notes while translating one policy, and builds errors that name it.
pub(crate) struct Ctx<'s> {
    pub key: Arc<PolicyKey>,
    pub warnings: Vec<String>,
    pub notes: Vec<String>,
    /// What `toServices` resolves against.
    pub services: &'s ServiceTable,
    pub uses_services: bool,
}

impl Ctx<'_> {
    pub fn err(&self, field: impl Into<String>, message: impl Into<String>) -> PolicyError {
        PolicyError {
            policy: self.key.to_string(),
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn note(&mut self, note: String) {
        if !self.notes.contains(&note) {
            self.notes.push(note);
        }
    }

    /// The origin of a peer rule (or requirement) of this policy at `path`.
    pub fn origin(
        &self,
        section: Section,
        path: impl Into<String>,
        l7: bool,
        tier: Option<Tier>,
    ) -> Arc<RuleOrigin> {
        Arc::new(RuleOrigin {
            policy: self.key.clone(),
            section,
            path: path.into(),
            l7,
            tier,
        })
    }

    pub fn namespace(&self) -> Option<&str> {
        self.key.namespace.as_deref()
    }
}

/// Renders a serde_ignored path as `a.b[0].c`.
fn render_ignored(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", render_ignored(parent)),
        Path::Map { parent, key } => {
            let p = render_ignored(parent);
            if p.is_empty() {
                key.to_string()
            } else {
                format!("{p}.{key}")
            }
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => render_ignored(parent),
    }
}

/// Deserialises `doc` into `T`, recording unknown fields and the path of a type error.
fn deserialize<T: DeserializeOwned>(
    doc: &Value,
    policy: &str,
    warnings: &mut Vec<String>,
) -> Result<T, PolicyError> {
    let mut ignored = Vec::new();
    let mut record = |p: serde_ignored::Path<'_>| ignored.push(render_ignored(&p));
    let de = serde_ignored::Deserializer::new(doc.clone(), &mut record);
    let result: Result<T, _> = serde_path_to_error::deserialize(de);
    match result {
        Ok(v) => {
            for f in ignored {
                warnings.push(format!("{policy}: ignoring unknown field {f}"));
            }
            Ok(v)
        }
        Err(e) => {
            let path = e.path().to_string();
            Err(PolicyError {
                policy: policy.to_string(),
                field: if path == "." {
                    "(document)".into()
                } else {
                    path
                },
                message: e.into_inner().to_string(),
            })
        }
    }
}

fn str_field<'a>(doc: &'a Value, path: &[&str]) -> Option<&'a str> {
    let mut v = doc;
    for p in path {
        v = v.get(p)?;
    }
    v.as_str()
}

/// Parses and validates one policy document. `default_namespace` applies when a namespaced
/// policy has no `metadata.namespace`; `location` names the document when it has no name
/// (e.g. `policies[3]` or `file.yaml#2`).
pub fn parse_policy(
    doc: &Value,
    default_namespace: &str,
    location: &str,
) -> Result<ParsedPolicy, PolicyError> {
    parse_policy_with_services(doc, default_namespace, location, &ServiceTable::default())
}

/// [`parse_policy`], resolving `toServices` against `services` (see `policy::services`).
pub fn parse_policy_with_services(
    doc: &Value,
    default_namespace: &str,
    location: &str,
    services: &ServiceTable,
) -> Result<ParsedPolicy, PolicyError> {
    if !doc.is_mapping() {
        return Err(PolicyError {
            policy: location.to_string(),
            field: "(document)".into(),
            message: "a policy must be a mapping with apiVersion, kind, metadata and spec".into(),
        });
    }
    let kind_str = str_field(doc, &["kind"]).unwrap_or("");
    let Some(kind) = PolicyKind::from_kind(kind_str) else {
        return Err(PolicyError {
            policy: location.to_string(),
            field: "kind".into(),
            message: if kind_str.is_empty() {
                format!("missing kind (expected {})", PolicyKind::expected())
            } else {
                format!(
                    "unsupported kind {kind_str:?} (expected {})",
                    PolicyKind::expected()
                )
            },
        });
    };
    let name = str_field(doc, &["metadata", "name"])
        .unwrap_or("")
        .to_string();
    let namespace = if kind.is_namespaced() {
        Some(
            str_field(doc, &["metadata", "namespace"])
                .filter(|s| !s.is_empty())
                .unwrap_or(default_namespace)
                .to_string(),
        )
    } else {
        None
    };
    // A name the API server would refuse is shown quoted and escaped (a newline in it would
    // split the one line its rejection gets).
    let valid_name = crate::policy::labels::is_dns1123_subdomain(&name);
    let key = Arc::new(PolicyKey {
        kind,
        namespace,
        name: if name.is_empty() {
            format!("<unnamed at {location}>")
        } else if !valid_name {
            format!("{name:?}")
        } else {
            name.clone()
        },
    });
    let mut ctx = Ctx {
        key: key.clone(),
        warnings: Vec::new(),
        notes: Vec::new(),
        services,
        uses_services: false,
    };
    if name.is_empty() {
        return Err(ctx.err("metadata.name", "missing name"));
    }
    if !valid_name {
        return Err(ctx.err(
            "metadata.name",
            "not a valid name: lowercase letters, digits, '-' and '.', starting and ending \
             with a letter or digit, at most 253 characters (as the API server requires)",
        ));
    }
    let (expected_api, family) = match (kind.info(), kind.family()) {
        (Some(info), Some(family)) => (info.api_version(), family),
        _ => return Err(ctx.err("kind", "the agent's own rules are never parsed")),
    };
    match str_field(doc, &["apiVersion"]) {
        Some(v) if v == expected_api => {}
        Some(v) => {
            return Err(ctx.err(
                "apiVersion",
                format!(
                    "unsupported apiVersion {v:?} for {} (expected {expected_api})",
                    kind.as_str()
                ),
            ))
        }
        None => {
            return Err(ctx.err(
                "apiVersion",
                format!("missing apiVersion (expected {expected_api})"),
            ))
        }
    }
    let staged = staged_mode(doc, &ctx)?;
    let policy_name = key.to_string();
    let mut rules = match family {
        Family::Kubernetes => {
            let np = deserialize(doc, &policy_name, &mut ctx.warnings)?;
            knp::translate(&mut ctx, &np)?
        }
        Family::NetworkPolicyApi if kind == PolicyKind::ClusterNetworkPolicy => {
            let p = deserialize(doc, &policy_name, &mut ctx.warnings)?;
            npa::translate_v1alpha2(&mut ctx, &p)?
        }
        Family::NetworkPolicyApi => {
            let p = deserialize(doc, &policy_name, &mut ctx.warnings)?;
            npa::translate_v1alpha1(&mut ctx, &p)?
        }
        Family::Cilium => {
            let cp = deserialize(doc, &policy_name, &mut ctx.warnings)?;
            cilium::translate(&mut ctx, &cp)?
        }
    };
    for r in &mut rules {
        r.staged = staged;
    }
    if staged {
        ctx.notes.push(format!(
            "staged ({MODE_ANNOTATION}: audit): resolved, not enforced; flows it would change carry its verdict as `staged`"
        ));
    }
    Ok(ParsedPolicy {
        key,
        rules,
        warnings: ctx.warnings,
        notes: ctx.notes,
        uses_services: ctx.uses_services,
        staged,
    })
}

impl fmt::Display for ParsedPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} rules)", self.key, self.rules.len())
    }
}

#[cfg(test)]
mod tests;
