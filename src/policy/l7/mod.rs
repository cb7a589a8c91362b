//! L7 rules as the proxies apply them: DNS rules ([`dns`], the DNS proxy's table) and HTTP
//! rules (the HTTP proxy's). The datapath only redirects a flow to a proxy; what an L7 rule
//! allows is decided here, the same way for the agent's proxies and for `policy simulate`.

pub mod dns;
pub mod http;
