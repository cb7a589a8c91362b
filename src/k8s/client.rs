//! The Kubernetes client the agent uses: from `--kubeconfig` outside a cluster, else the pod's
//! service account (`KUBERNETES_SERVICE_HOST`, the mounted token and CA) inside one.

use std::path::Path;

use kube::config::{KubeConfigOptions, Kubeconfig};

/// Why no client could be built; the message names the file or the missing piece.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--kubeconfig {path}: {message}")]
    Kubeconfig { path: String, message: String },
    #[error(
        "in-cluster configuration (service account): {0}; outside a cluster pass --kubeconfig FILE"
    )]
    InCluster(String),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(String),
}

/// True when running in a pod (the variables the kubelet sets for in-cluster clients).
pub fn in_cluster() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
}

/// Builds a client, with the API server's address when its URL names one (an address, or a
/// name that resolves). Must run inside a tokio runtime.
pub async fn make_client(
    kubeconfig: Option<&Path>,
) -> Result<(kube::Client, Option<std::net::SocketAddr>), ClientError> {
    let config = match kubeconfig {
        Some(path) => {
            let named = |message: String| ClientError::Kubeconfig {
                path: path.display().to_string(),
                message,
            };
            let kc = Kubeconfig::read_from(path).map_err(|e| named(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| named(e.to_string()))?
        }
        None => kube::Config::incluster().map_err(|e| ClientError::InCluster(e.to_string()))?,
    };
    let url = &config.cluster_url;
    let port = url
        .port_u16()
        .unwrap_or(if url.scheme_str() == Some("http") {
            80
        } else {
            443
        });
    let host = url
        .host()
        .unwrap_or_default()
        .trim_matches(['[', ']'])
        .to_string();
    let addr = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => Some(std::net::SocketAddr::new(ip, port)),
        Err(_) => tokio::net::lookup_host((host.as_str(), port))
            .await
            .ok()
            .and_then(|mut a| a.next()),
    };
    let client = kube::Client::try_from(config).map_err(|e| ClientError::Client(e.to_string()))?;
    Ok((client, addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An HTTPS API server needs the TLS stack to be usable at run time (rustls with its
    /// crypto provider): building the client must work, and a request must fail cleanly (no
    /// server listens) instead of panicking.
    #[tokio::test(flavor = "current_thread")]
    async fn https_clients_build_and_fail_cleanly_without_a_server() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("kubeconfig");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{port}', insecure-skip-tls-verify: true}}}}]
contexts: [{{name: c, context: {{cluster: c, user: u}}}}]
current-context: c
users: [{{name: u, user: {{token: t}}}}]
"
            ),
        )
        .expect("write kubeconfig");
        let (client, _) = make_client(Some(&path)).await.expect("an HTTPS client");
        let err = client
            .apiserver_version()
            .await
            .expect_err("nothing listens there");
        assert!(!err.to_string().is_empty());
        match make_client(Some(&dir.path().join("nope"))).await {
            Err(e) => assert!(e.to_string().contains("--kubeconfig"), "{e}"),
            Ok(_) => panic!("a missing kubeconfig must be an error"),
        }
    }
}
