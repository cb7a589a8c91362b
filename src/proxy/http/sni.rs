//! The server name (SNI) of a TLS ClientHello, read without terminating TLS: what
//! `serverNames` rules are judged by.

/// What the first bytes of a connection say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// More bytes are needed (at most a record: 16 KiB and its header).
    Incomplete,
    /// Not a TLS ClientHello.
    NotTls,
    /// A ClientHello, with its server name if it sent one.
    ServerName(Option<String>),
}

/// The largest ClientHello read (one TLS record).
pub const MAX_HELLO: usize = 5 + (1 << 14);

fn u16_at(b: &[u8], i: usize) -> Option<usize> {
    Some(((*b.get(i)? as usize) << 8) | *b.get(i + 1)? as usize)
}

/// Reads the ClientHello at the start of `b`.
pub fn client_hello(b: &[u8]) -> Hello {
    if b.len() < 5 {
        return if b.first().is_some_and(|t| *t != 0x16) {
            Hello::NotTls
        } else {
            Hello::Incomplete
        };
    }
    if b[0] != 0x16 || b[1] != 3 {
        return Hello::NotTls;
    }
    let Some(len) = u16_at(b, 3) else {
        return Hello::Incomplete;
    };
    if len > 1 << 14 {
        return Hello::NotTls;
    }
    if b.len() < 5 + len {
        return Hello::Incomplete;
    }
    match parse(&b[5..5 + len]) {
        Some(h) => h,
        None => Hello::NotTls,
    }
}

fn parse(h: &[u8]) -> Option<Hello> {
    if *h.first()? != 1 {
        return Some(Hello::NotTls);
    }
    let body_len = ((*h.get(1)? as usize) << 16) | u16_at(h, 2)?;
    // A ClientHello spread over several records is not read (nor allowed).
    let body = h.get(4..4 + body_len)?;
    let mut i = 2 + 32; // version, random
    let sid = *body.get(i)? as usize;
    i += 1 + sid;
    i += 2 + u16_at(body, i)?; // cipher suites
    i += 1 + *body.get(i)? as usize; // compression methods
    if i == body.len() {
        return Some(Hello::ServerName(None));
    }
    let ext_end = i + 2 + u16_at(body, i)?;
    i += 2;
    let exts = body.get(..ext_end)?;
    while i + 4 <= exts.len() {
        let (ty, len) = (u16_at(exts, i)?, u16_at(exts, i + 2)?);
        let data = exts.get(i + 4..i + 4 + len)?;
        if ty == 0 {
            let mut j = 2;
            while j + 3 <= data.len() {
                let (kind, n) = (data[j], u16_at(data, j + 1)?);
                let name = data.get(j + 3..j + 3 + n)?;
                if kind == 0 {
                    let name = std::str::from_utf8(name).ok()?;
                    return Some(Hello::ServerName(Some(name.to_string())));
                }
                j += 3 + n;
            }
        }
        i += 4 + len;
    }
    Some(Hello::ServerName(None))
}

/// A minimal ClientHello naming `name` (tests and benches).
pub fn client_hello_for(name: &str) -> Vec<u8> {
    // server_name extension: type 0, then its data: the list's length, one entry (type 0,
    // length, name).
    let mut data = Vec::new();
    data.extend_from_slice(&((3 + name.len()) as u16).to_be_bytes());
    data.push(0);
    data.extend_from_slice(&(name.len() as u16).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    let mut sni = vec![0u8, 0];
    sni.extend_from_slice(&(data.len() as u16).to_be_bytes());
    sni.extend_from_slice(&data);
    let mut body = vec![3u8, 3];
    body.extend_from_slice(&[7u8; 32]);
    body.push(0); // session id
    body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one cipher suite
    body.extend_from_slice(&[1, 0]); // null compression
    body.extend_from_slice(&(sni.len() as u16).to_be_bytes());
    body.extend_from_slice(&sni);
    let mut hs = vec![1u8];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_name_is_read_from_a_client_hello_in_pieces() {
        let hello = client_hello_for("api.example.com");
        assert_eq!(
            client_hello(&hello),
            Hello::ServerName(Some("api.example.com".into()))
        );
        assert_eq!(client_hello(&hello[..3]), Hello::Incomplete);
        assert_eq!(client_hello(&hello[..hello.len() - 1]), Hello::Incomplete);
        assert_eq!(client_hello(b"GET / HTTP/1.1\r\n"), Hello::NotTls);
        let mut broken = hello.clone();
        let n = broken.len();
        broken[n - 16] = 0xff; // the name's length runs past the record
        assert_ne!(
            client_hello(&broken),
            Hello::ServerName(Some("api.example.com".into()))
        );
    }
}
