//! What the HTTP proxy checks before any rule, and its own answers.
//!
//! A request the server could read differently from the proxy is refused with `400`:
//! `Content-Length` together with `Transfer-Encoding`, `Content-Length` twice, `Host` twice, a
//! target that is neither a path nor an absolute URL or holds a malformed escape. (hyper
//! refuses obsolete line folding and malformed framing itself.) What is forwarded is what the
//! rules matched: the normalised target in origin form, `Host` set to the authority an
//! absolute-form target named, and hyper re-framing the body.

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, Uri, Version};
use http_body_util::Full;

use crate::policy::l7::http::{normalize_target, HeaderAction, RequestHeaders};

/// The body of a denied request (Envoy's and so Cilium's).
pub const ACCESS_DENIED: &str = "Access denied\r\n";

/// A request's head as rules see it (after [`prepare`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    pub method: String,
    /// Normalised path and query.
    pub path: String,
    pub host: String,
    /// The URL for the record (`http://host/path`).
    pub url: String,
}

/// Why a request is refused before any rule (answered `400`), if it is.
pub fn ambiguous(headers: &HeaderMap) -> Option<&'static str> {
    let cl = headers.get_all(CONTENT_LENGTH).iter().count();
    if cl > 0 && headers.contains_key(TRANSFER_ENCODING) {
        return Some("both Content-Length and Transfer-Encoding");
    }
    if cl > 1 {
        return Some("Content-Length more than once");
    }
    if headers.get_all(HOST).iter().count() > 1 {
        return Some("Host more than once");
    }
    None
}

/// Normalises the request's target in place (origin form for HTTP/1.1, the authority kept
/// for HTTP/2) and returns what rules match against. `Err`: answered `400`.
pub fn prepare(
    method: &Method,
    uri: &mut Uri,
    version: Version,
    headers: &mut HeaderMap,
) -> Result<Prepared, &'static str> {
    if let Some(why) = ambiguous(headers) {
        return Err(why);
    }
    let raw = if uri.scheme().is_some() {
        uri.to_string()
    } else {
        uri.path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into())
    };
    let target = if method == Method::CONNECT {
        return Err("CONNECT is not proxied");
    } else {
        normalize_target(&raw)?
    };
    let host = match (&target.authority, uri.authority(), headers.get(HOST)) {
        (Some(a), _, _) => a.clone(),
        (None, Some(a), _) => a.as_str().to_string(),
        (None, None, Some(h)) => h.to_str().map_err(|_| "a Host that is not text")?.into(),
        (None, None, None) => String::new(),
    };
    if target.authority.is_some() && version < Version::HTTP_2 {
        // The absolute form's authority replaces Host (RFC 9112 section 3.2.2).
        let v = HeaderValue::from_str(&host).map_err(|_| "a malformed authority")?;
        headers.insert(HOST, v);
    }
    let new_uri = if version >= Version::HTTP_2 {
        let scheme = uri.scheme_str().unwrap_or("http").to_string();
        Uri::builder()
            .scheme(scheme.as_str())
            .authority(host.as_str())
            .path_and_query(target.path_and_query.as_str())
            .build()
    } else {
        Uri::builder()
            .path_and_query(target.path_and_query.as_str())
            .build()
    };
    *uri = new_uri.map_err(|_| "a target that cannot be forwarded")?;
    Ok(Prepared {
        method: method.as_str().to_string(),
        url: format!("http://{host}{}", target.path_and_query),
        path: target.path_and_query,
        host,
    })
}

/// A header map as rules read it.
pub struct Headers<'a>(pub &'a HeaderMap);

impl RequestHeaders for Headers<'_> {
    fn values(&self, name: &str) -> Vec<&str> {
        self.0
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    }
}

/// Applies a matching rule's header actions (`headerMatches` ADD, DELETE, REPLACE).
pub fn apply_actions(headers: &mut HeaderMap, actions: &[HeaderAction]) {
    for a in actions {
        match a {
            HeaderAction::Add(n, v) | HeaderAction::Replace(n, v) => {
                let (Ok(name), Ok(value)) = (
                    http::header::HeaderName::from_bytes(n.as_bytes()),
                    HeaderValue::from_str(v),
                ) else {
                    continue;
                };
                if matches!(a, HeaderAction::Add(..)) {
                    headers.append(name, value);
                } else {
                    headers.insert(name, value);
                }
            }
            HeaderAction::Delete(n) => {
                headers.remove(n.as_str());
            }
        }
    }
}

/// A gRPC call (its failures are answered in gRPC's words).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// The answer to a denied request: `403 Access denied`, or for gRPC a trailers-only
/// `PERMISSION_DENIED` (status 7), as Envoy maps 403 for gRPC.
pub fn denied(grpc: bool) -> Response<Full<Bytes>> {
    if grpc {
        return grpc_status(7, "Access denied");
    }
    let mut r = Response::new(Full::new(Bytes::from_static(ACCESS_DENIED.as_bytes())));
    *r.status_mut() = StatusCode::FORBIDDEN;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// A gRPC failure without a body (trailers-only: the status in the headers).
pub fn grpc_status(code: u32, message: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::new()));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert("grpc-status", HeaderValue::from(code));
    if let Ok(m) = HeaderValue::from_str(message) {
        h.insert("grpc-message", m);
    }
    r
}

/// `400` with why, or `UNAVAILABLE`-style 503 for gRPC.
pub fn status(code: StatusCode, why: &str, grpc: bool) -> Response<Full<Bytes>> {
    if grpc {
        let g = if code == StatusCode::BAD_REQUEST {
            13
        } else {
            14
        };
        return grpc_status(g, why);
    }
    let mut r = Response::new(Full::new(Bytes::from(format!("{why}\r\n"))));
    *r.status_mut() = code;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(
        target: &str,
        headers: &[(&str, &str)],
        v: Version,
    ) -> (Uri, HeaderMap, Result<Prepared, &'static str>) {
        let mut uri: Uri = target.parse().unwrap();
        let mut h = HeaderMap::new();
        for (n, val) in headers {
            h.append(
                http::header::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(val).unwrap(),
            );
        }
        let p = prepare(&Method::GET, &mut uri, v, &mut h);
        (uri, h, p)
    }

    #[test]
    fn ambiguous_framing_and_duplicate_host_are_refused() {
        let v = Version::HTTP_11;
        assert!(head(
            "/",
            &[("content-length", "3"), ("transfer-encoding", "chunked")],
            v
        )
        .2
        .is_err());
        assert!(
            head("/", &[("content-length", "3"), ("content-length", "3")], v)
                .2
                .is_err()
        );
        assert!(head("/", &[("host", "a"), ("host", "b")], v).2.is_err());
        assert!(head("/", &[("host", "a"), ("content-length", "0")], v)
            .2
            .is_ok());
    }

    #[test]
    fn the_forwarded_target_is_the_matched_one() {
        let (uri, _, p) = head(
            "/public/../admin?x",
            &[("host", "echo:8080")],
            Version::HTTP_11,
        );
        let p = p.unwrap();
        assert_eq!(
            (p.path.as_str(), p.host.as_str()),
            ("/admin?x", "echo:8080")
        );
        assert_eq!(uri.to_string(), "/admin?x");
        // Absolute form: the authority replaces Host, origin form upstream.
        let (uri, h, p) = head(
            "http://echo:8080//private",
            &[("host", "evil")],
            Version::HTTP_11,
        );
        let p = p.unwrap();
        assert_eq!(
            (p.path.as_str(), p.host.as_str()),
            ("/private", "echo:8080")
        );
        assert_eq!(uri.to_string(), "/private");
        assert_eq!(h.get(HOST).unwrap(), "echo:8080");
        // HTTP/2 keeps the authority in the URI.
        let (uri, _, p) = head("http://echo:8080/a/./b", &[], Version::HTTP_2);
        assert_eq!(p.unwrap().path, "/a/b");
        assert_eq!(uri.to_string(), "http://echo:8080/a/b");
    }

    #[test]
    fn a_denied_grpc_call_is_permission_denied_in_the_headers() {
        let r = denied(true);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "7");
        let r = denied(false);
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
    }
}
