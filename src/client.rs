//! The CLI's side of the REST API: HTTP/1.1 over the agent's unix socket, and table rendering.
//!
//! A dozen lines of HTTP by hand: the requests are tiny, `Connection: close` keeps the framing
//! trivial, and no HTTP client crate speaks unix sockets without pulling in a second runtime.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Client failures, naming the socket or the request.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach the agent at {socket}: {source} (is `ciliate agent` running? see --socket)"
    )]
    Connect {
        socket: String,
        source: std::io::Error,
    },
    #[error("{method} {path}: {source}")]
    Io {
        method: String,
        path: String,
        source: std::io::Error,
    },
    #[error("{method} {path}: malformed response from the agent")]
    Malformed { method: String, path: String },
    #[error("{method} {path}: HTTP {status}: {message}")]
    Status {
        method: String,
        path: String,
        status: u16,
        message: String,
    },
    /// The command line itself is wrong (nothing was sent).
    #[error("{0}")]
    Usage(String),
}

/// Sends one request; returns the body of a 2xx response.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<String, ClientError> {
    let mut s = UnixStream::connect(socket).map_err(|e| ClientError::Connect {
        socket: socket.display().to_string(),
        source: e,
    })?;
    let io = |e| ClientError::Io {
        method: method.into(),
        path: path.into(),
        source: e,
    };
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(io)?;
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: ciliate\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(io)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(io)?;
    let malformed = || ClientError::Malformed {
        method: method.into(),
        path: path.into(),
    };
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(malformed)?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut payload = raw[split + 4..].to_vec();
    let status: u16 = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(malformed)?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if chunked {
        payload = dechunk(&payload).ok_or_else(malformed)?;
    }
    let text = String::from_utf8_lossy(&payload).to_string();
    if (200..300).contains(&status) {
        Ok(text)
    } else {
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or(text);
        Err(ClientError::Status {
            method: method.into(),
            path: path.into(),
            status,
            message,
        })
    }
}

/// Streams a response line by line (`GET` of a streaming endpoint such as `/v1/monitor`):
/// `on_line` is called for every complete line until it returns false or the agent closes.
pub fn stream_lines(
    socket: &Path,
    path: &str,
    mut on_line: impl FnMut(&str) -> bool,
) -> Result<(), ClientError> {
    use std::io::BufRead;
    let s = UnixStream::connect(socket).map_err(|e| ClientError::Connect {
        socket: socket.display().to_string(),
        source: e,
    })?;
    let io = |e| ClientError::Io {
        method: "GET".into(),
        path: path.into(),
        source: e,
    };
    let malformed = || ClientError::Malformed {
        method: "GET".into(),
        path: path.into(),
    };
    (&s).write_all(
        format!("GET {path} HTTP/1.1\r\nHost: ciliate\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .map_err(io)?;
    let mut r = std::io::BufReader::new(&s);
    let mut status_line = String::new();
    r.read_line(&mut status_line).map_err(io)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(malformed)?;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).map_err(io)?;
        if h.trim().is_empty() {
            break;
        }
        let l = h.to_ascii_lowercase();
        chunked |= l.starts_with("transfer-encoding:") && l.contains("chunked");
    }
    if !(200..300).contains(&status) {
        let mut body = String::new();
        let _ = r.read_to_string(&mut body);
        return Err(ClientError::Status {
            method: "GET".into(),
            path: path.into(),
            status,
            message: body,
        });
    }
    let mut pending = String::new();
    loop {
        let piece = if chunked {
            let mut size = String::new();
            if r.read_line(&mut size).map_err(io)? == 0 {
                return Ok(());
            }
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| malformed())?;
            if n == 0 {
                return Ok(());
            }
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf).map_err(io)?;
            buf.truncate(n);
            buf
        } else {
            let mut buf = Vec::new();
            if r.read_until(b'\n', &mut buf).map_err(io)? == 0 {
                return Ok(());
            }
            buf
        };
        pending.push_str(&String::from_utf8_lossy(&piece));
        while let Some(i) = pending.find('\n') {
            let line: String = pending.drain(..=i).collect();
            if !on_line(line.trim_end()) {
                return Ok(());
            }
        }
    }
}

fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&data[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(data.get(..size)?);
        data = data.get(size + 2..)?;
    }
}

/// A cell wider than this does not widen its column: it pushes the rest of its own row right
/// instead. Otherwise one wide cell (a name with thousands of addresses in `fqdn cache list`)
/// pads every row to its width, and the table grows as rows x widest cell (68,727 cache
/// entries, one name with 2,000 addresses: 1.45 GB of table in about 9 s, JSON in 0.4 s).
pub const WIDEST_ALIGNED: usize = 64;

/// Renders rows as an aligned text table. Linear in the cells' text: each line is its cells,
/// padded to their column's width (at most [`WIDEST_ALIGNED`]) but the last, two spaces apart,
/// without trailing spaces.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let chars = |c: &str| c.chars().count();
    let mut widths: Vec<usize> = headers.iter().map(|h| chars(h)).collect();
    let mut size = 0;
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            let n = chars(c);
            size += c.len() + 2;
            if i >= widths.len() {
                widths.push(0);
            }
            if n <= WIDEST_ALIGNED {
                widths[i] = widths[i].max(n);
            }
        }
    }
    let mut out = String::with_capacity(size + (rows.len() + 1) * widths.iter().sum::<usize>());
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let start = out.len();
        for (i, c) in cells.enumerate() {
            if i > 0 {
                out.push_str("  ");
            }
            out.push_str(c);
            let pad = widths[i].saturating_sub(chars(c));
            out.extend(std::iter::repeat_n(' ', pad));
        }
        let kept = out[start..].trim_end().len();
        out.truncate(start + kept);
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for r in rows {
        line(&mut r.iter().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunks() {
        assert_eq!(
            dechunk(b"4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n").unwrap(),
            b"Wikipedia"
        );
        assert!(dechunk(b"zz\r\n").is_none());
    }

    #[test]
    fn a_wide_cell_never_pads_the_other_rows_so_each_line_costs_its_own_cells() {
        // `fqdn cache list` of 100,000 names, one of them with 150 addresses: formerly every
        // row was padded to that cell, output rows x widest cell. Each line must cost its own
        // cells plus a bounded padding, whatever the other rows hold.
        let wide: Vec<String> = (0..150)
            .map(|i| format!("10.0.{}.{}", i / 100, i))
            .collect();
        let wide = wide.join(",");
        let rows: Vec<Vec<String>> = (0..100_000)
            .map(|i| {
                let ips = if i == 7 {
                    wide.clone()
                } else {
                    format!("198.18.{}.{}", i / 256 % 256, i % 256)
                };
                vec![
                    format!("n{i}.example.com"),
                    ips,
                    (1_764_150_000 + i).to_string(),
                    "1,2".into(),
                ]
            })
            .collect();
        let out = table(&["NAME", "IPS", "EXPIRES_AT", "ENDPOINTS"], &rows);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), rows.len() + 1);
        for (line, row) in lines[1..].iter().zip(&rows) {
            let own: usize = row.iter().map(|c| c.len().max(WIDEST_ALIGNED)).sum();
            assert!(
                line.len() <= own + 2 * (row.len() - 1),
                "{} bytes for cells of {own}: {:.100}",
                line.len(),
                line
            );
            let cells: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(cells, *row, "every cell, in order");
        }
        // The ordinary rows stay aligned with the header; the wide one is printed whole.
        let at = |l: &str, what: &str| l.find(what).unwrap();
        assert_eq!(at(lines[0], "IPS"), at(lines[1], "198.18."));
        assert_eq!(at(lines[0], "EXPIRES_AT"), at(lines[100_000], "1764"));
        assert!(lines[8].contains(&wide));
    }

    #[test]
    fn tables_align() {
        let t = table(
            &["ID", "NAME"],
            &[
                vec!["1".into(), "x/a".into()],
                vec!["1234".into(), "b".into()],
            ],
        );
        assert_eq!(t, "ID    NAME\n1     x/a\n1234  b\n");
    }
}
