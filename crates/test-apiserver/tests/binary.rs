//! The `ciliate-test-apiserver` binary: writes a kubeconfig, serves the API, stops on SIGTERM.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_binary_serves_until_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ciliate-test-apiserver"))
        .args(["--listen", "127.0.0.1:0", "--kubeconfig-out"])
        .arg(&kubeconfig)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn ciliate-test-apiserver");
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        if let Ok(t) = std::fs::read_to_string(&kubeconfig) {
            if !t.is_empty() {
                break t;
            }
        }
        assert!(Instant::now() < deadline, "no kubeconfig written");
        std::thread::sleep(Duration::from_millis(50));
    };
    let parsed: serde_yaml::Value = serde_yaml::from_str(&text).expect("kubeconfig parses");
    let url = parsed["clusters"][0]["cluster"]["server"]
        .as_str()
        .expect("server url")
        .to_string();
    let addr = url.trim_start_matches("http://").to_string();
    let mut conn = std::net::TcpStream::connect(&addr).expect("connect");
    write!(
        conn,
        "GET /api/v1/namespaces/default HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut reply = String::new();
    conn.read_to_string(&mut reply).expect("read");
    assert!(
        reply.starts_with("HTTP/1.1 200") && reply.contains(r#""name":"default""#),
        "{reply}"
    );
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = child.wait().expect("wait");
    assert!(status.success(), "exit status {status}");
}
