/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The single source of truth for every structure shared between the BPF datapath and user
 * space. Rust uses the skeleton's generated `types::*` for these; a test pins their sizes and
 * field offsets so a change here cannot silently break the ABI.
 */
#ifndef CILIATE_H
#define CILIATE_H

#define CILIATE_POLICY_MAP_MAX 16384
#define CILIATE_IPCACHE_MAX 512000
#define CILIATE_ENDPOINTS_MAX 65536
#define CILIATE_CT_MAX 262144
#define CILIATE_EVENTS_BYTES (1 << 20)

/* Reserved identities the datapath needs (same numbers as the policy engine). */
#define CILIATE_ID_HOST 1
#define CILIATE_ID_REMOTE_NODE 6
#define CILIATE_ID_WORLD_IPV4 9
#define CILIATE_ID_WORLD_IPV6 10

/* The host endpoint (`--enable-host-firewall`; `endpoint::host`): its slot in the endpoint map
 * and policy maps. While that slot holds no identity there is no host firewall. */
#define CILIATE_HOST_ENDPOINT_ID 65535
/* The bit from_container sets in skb->mark of what a pod sends on: at the node's device the
 * host firewall tells the node's own packets from pods' ones, which may carry the node's
 * address by then (masqueraded, or encapsulated for the tunnel). */
#define CILIATE_MARK_FROM_POD 0x08000000
/* The tunnel's UDP port (VXLAN, as Cilium's): exempt from the host firewall between nodes. */
#define CILIATE_TUNNEL_PORT 8472
/* The most nodes the tunnel's exemption knows (tunnel_peers). */
#define CILIATE_TUNNEL_PEERS_MAX 16384

/* Endpoint flags (struct endpoint_info.flags). */
#define CILIATE_EP_INGRESS_DEFAULT_DENY 0x1
#define CILIATE_EP_EGRESS_DEFAULT_DENY 0x2
/* The policy could not be realized: drop all IP traffic (fail closed; ARP still passes). */
#define CILIATE_EP_DROP_ALL 0x4
/* port_prefix_lens and any_identity_lens are split by identity class (this version's writers
 * always set it). Without it (a record written by an older agent) the program probes every
 * class with port_prefix_lens, as older programs did, so an upgrade never skips a deny. */
#define CILIATE_EP_SPLIT_LENS 0x8
/* Audit mode: a would-be policy drop passes and is reported as an audit verdict. */
#define CILIATE_EP_AUDIT 0x10
/* Egress policy has DNS rules: allowed DNS (UDP and TCP 53) goes to the DNS proxy. */
#define CILIATE_EP_DNS_PROXY 0x20
#define CILIATE_DNS_PORT 53

/* Probe-mask bits: bit n (0..16) = entries of one protocol with port prefix length n (0 = the
 * whole protocol); this bit = entries for every protocol (protocol 0). */
#define CILIATE_LENS_ALL_PROTOCOLS (1u << 17)

/* Verdict reasons (struct verdict_event.reason, the counters map index). One enum for all. */
enum ciliate_reason {
	CILIATE_ALLOW_POLICY = 0,
	CILIATE_ALLOW_NOT_ISOLATED = 1,
	CILIATE_ALLOW_ESTABLISHED = 2,
	CILIATE_ALLOW_REPLY = 3,
	CILIATE_DROP_POLICY_DENY = 4,
	CILIATE_DROP_DEFAULT_DENY = 5,
	CILIATE_DROP_NOT_REALIZED = 6,
	CILIATE_DROP_MALFORMED = 7,
	CILIATE_PASS_UNMANAGED = 8,
	CILIATE_PASS_NOT_IP = 9, /* not IP, or IPv6 link control (neighbour discovery, MLD) */
	/* Counted besides the verdict: an allowed connection could not be tracked (table full),
	 * so its replies meet policy again (fail closed where they are not allowed). */
	CILIATE_CT_FULL = 10,
	/* Audit mode let through what policy would have dropped. */
	CILIATE_AUDIT_POLICY_DENY = 11,
	CILIATE_AUDIT_DEFAULT_DENY = 12,
	/* Counted besides the verdict: its event did not fit in the ring buffer (lost). */
	CILIATE_EVENTS_LOST = 13,
	/* Tunnel mode: a packet to the tunnel's port on the node's address from a sender that is
	 * no tunnel peer (lib/tunnel.h). */
	CILIATE_DROP_TUNNEL_NOT_A_PEER = 14,
	CILIATE_REASON_MAX = 15,
};

/* ipcache, part 1: host addresses (/32, /128: pods and nodes, nearly all entries) in a hash,
 * one lookup; part 2: every shorter prefix in a longest-prefix-match trie, probed only when the
 * address is no known host. A host entry is always the longest match, so the order is exact. */
struct ipcache_host_key {
	__u32 family; /* 4 or 6 */
	__u8 addr[16];
};

/* ipcache, part 2: longest-prefix match. prefixlen counts the family word too (32 + prefix). */
struct ipcache_key {
	__u32 prefixlen;
	__u32 family; /* 4 or 6 */
	__u8 addr[16];
};

struct ipcache_value {
	__u32 identity;
	__u32 pad;
};

/* This node's own IPv4 addresses (the ipcache's host entries of identity host), mirrored by
 * the agent into one record so that "is this packet for the node?" costs a few compares on
 * the node device's paths instead of a hash lookup. Each slot holds an address in network
 * order or 0; the agent changes one slot per update. With more addresses than slots,
 * `overflow` is set and the programs ask the ipcache's host table instead. */
#define CILIATE_HOST_ADDRS4_MAX 8
struct host_addrs4 {
	__u32 addr[CILIATE_HOST_ADDRS4_MAX];
	__u32 overflow;
	__u32 pad;
};

/* The endpoint map: an array indexed by the (16-bit) endpoint id -> what the program needs to
 * know about it. A slot with identity 0 holds no endpoint. */
struct endpoint_info {
	__u32 identity;
	__u32 flags;
	/* What the policy map holds, as probe masks (CILIATE_LENS_* bits): entries for specific
	 * peer identities, and entries for any peer (identity 0). Lookups only probe what is in
	 * use, so an endpoint with exact-port rules costs one or two hash lookups. */
	__u32 port_prefix_lens;
	__u32 any_identity_lens;
	/* Attribution of a default deny: the cookie of the policies that isolate the endpoint in
	 * each direction (0: unknown, a record of an older agent). Appended fields read as 0 in
	 * records migrated from an older version. */
	__u32 ingress_cookie;
	__u32 egress_cookie;
};

/* One policy map per endpoint (an inner map of policy_maps). */
struct policy_key {
	__u32 identity; /* 0: any peer */
	__u8 egress;
	__u8 protocol; /* 0: any protocol (then port and prefix length are 0) */
	__u16 port;    /* host byte order; ICMP: the type */
	__u8 port_prefix_len;
	__u8 pad[3];
};

struct policy_value {
	__u8 deny;
	/* Allows only: an L7 rule (HTTP, TLS server names) covers this entry, so a connection it
	 * allows goes to the HTTP proxy (any allow entry matching a packet with it set is enough:
	 * the proxy judges by every allowing rule). 0 in entries of older agents. */
	__u8 proxy;
	__u8 pad[2];
	/* Attribution: the rules this entry was derived from, as a cookie the agent resolves
	 * (policy kind, namespace, name, rule). 0: unknown (written by an older agent). */
	__u32 cookie;
	__u64 packets;
	__u64 bytes;
};

/* Connection tracking, keyed by the tuple as the endpoint sends or receives it. IPv4 and IPv6
 * have a table each: hashing and comparing the key is most of a lookup, and the IPv4 key is
 * less than half the size of the IPv6 one. */
struct ct4_key {
	__u8 saddr[4];
	__u8 daddr[4];
	__u16 sport;
	__u16 dport;
	__u8 protocol;
	__u8 pad[3];
	__u32 endpoint_id;
};

/* The IPv6 key; also the layout of the single table (`conntrack`) of older versions, whose
 * entries the agent moves into the two tables. */
struct ct6_key {
	__u8 saddr[16];
	__u8 daddr[16];
	__u16 sport;
	__u16 dport;
	__u8 protocol;
	__u8 family;
	__u16 pad;
	__u32 endpoint_id;
};

struct ct_value {
	__u64 last_seen_ns; /* bpf_ktime_get_coarse_ns(): CLOCK_MONOTONIC, tick resolution */
	__u64 packets;
	__u8 egress;  /* the direction that opened the connection */
	__u8 replied; /* a reply was seen (an unanswered TCP SYN expires sooner) */
	__u8 closing; /* TCP: a FIN or RST was seen (the entry expires soon after) */
	/* An ingress connection delivered straight from the node's device (BPF host routing), so
	 * no netfilter NAT of this node touched it: its replies may skip the host stack too.
	 * Connections that came in through the stack (0) reply through it, which translates back
	 * whatever it translated (a kube-proxy NodePort or hostPort DNAT). */
	__u8 direct;
	/* The connection goes to the DNS proxy (CILIATE_EP_DNS_PROXY when it opened). */
	__u8 dns_proxy;
	/* The connection was redirected to the HTTP proxy where it opened (its packets from the
	 * client keep going there). */
	__u8 l7;
	/* The connection is the HTTP proxy's own, made on behalf of a client (the proxy marked
	 * its SYN, or the proxy recorded it): replies go to the proxy's socket, not the pod. */
	__u8 proxy_upstream;
	__u8 pad;
};

/* Conntrack expiry (Cilium's defaults), applied by the agent's garbage collector: an entry not
 * seen for this long is removed. Zero-initialised fields of entries written by older versions
 * read as "not replied, not closing": the longest timeouts that can apply, never a cut flow. */
#define CILIATE_CT_TIMEOUT_TCP_SEC 21600
#define CILIATE_CT_TIMEOUT_TCP_SYN_SEC 60
#define CILIATE_CT_TIMEOUT_TCP_CLOSING_SEC 10
#define CILIATE_CT_TIMEOUT_ANY_SEC 60

/* One policy verdict, sent to user space (drops always, allows when configured). */
struct verdict_event {
	__u64 timestamp_ns;
	__u32 endpoint_id;
	__u32 peer_identity;
	__u8 egress;
	__u8 protocol;
	__u16 port;
	__u8 reason;
	__u8 family;
	/* The source port (TCP, UDP, SCTP; 0 otherwise), host order; 0 from an older program. */
	__u16 sport;
	__u8 saddr[16];
	__u8 daddr[16];
	/* The deciding entry's cookie (allow, deny rule), or the endpoint's isolation cookie
	 * (default deny); 0 when nothing attributes it. */
	__u32 cookie;
	/* The packet's TCP flags byte (FIN 0x01, SYN 0x02, RST 0x04, PSH 0x08, ACK 0x10, ...). */
	__u8 tcp_flags;
	__u8 pad2[3];
};

/* An IPv4 verdict event as a batch carries it: the fields of struct verdict_event in 40 bytes
 * instead of 64 (copying events into the ring buffer's memory is most of what an event costs).
 * `family` (4) sits at the same offset as in struct verdict_event, which is how a reader tells
 * the two apart; endpoint ids are 16-bit (CILIATE_ENDPOINTS_MAX). Batches of the first form
 * (CILIATE_EVENT_RECORD_MARK_V1) carried its first 32 bytes only. */
struct verdict_event4 {
	__u64 timestamp_ns;
	__u32 peer_identity;
	__u32 cookie;
	__u8 egress;
	__u8 protocol;
	__u16 port;
	__u8 reason;
	__u8 family;
	__u16 endpoint_id;
	__u8 saddr[4];
	__u8 daddr[4];
	__u16 sport;
	__u8 tcp_flags;
	__u8 pad[5];
};

/* Verdict events wait per CPU in a batch and go to the ring buffer as one record: this marker
 * (never a timestamp: bit 63 is set), then the events back to back, each a struct
 * verdict_event4 (IPv4) or a struct verdict_event (IPv6). A record without the marker is one
 * struct verdict_event alone (a CPU beyond the batch array, or an older program). A batch
 * leaves when the next event might not fit, or CILIATE_EVENT_FLUSH_NS after its first event
 * (a timer on that CPU). */
#define CILIATE_EVENT_RECORD_MARK 0xC11A7EBA7C000002ULL
/* The mark of an older program's batches, whose IPv4 events end after `daddr` (32 bytes). */
#define CILIATE_EVENT_RECORD_MARK_V1 0xC11A7EBA7C000001ULL
/* The form of this program's batches (the mark's last byte). */
#define CILIATE_EVENT_FORM 2
#define CILIATE_EVENT_BATCH_BYTES 2048
#define CILIATE_EVENT_FLUSH_NS 1000000
/* Slots of the batch array when the loader does not size it to the possible CPUs. */
#define CILIATE_EVENT_BATCH_CPUS 256

/* Tunnel mode in BPF (bpf/lib/tunnel.h), the one element of tunnel_config: the agent's tunnel
 * device (0: the kernel's device does all the tunnel's work) and the node's IPv4 address the
 * outer packets leave from (network order; 0: receive side only). */
struct tunnel_config {
	__u32 ifindex;
	__u32 local4;
};

/* BPF host routing, receive side: a local pod's IPv4 address (network order, the key of
 * local_endpoints) -> where a packet for it arriving on the node's device is delivered once
 * its policy allowed it (bpf_redirect_peer into the pod, with these addresses). */
struct local_endpoint {
	__u32 endpoint_id;
	__u32 ifindex;     /* the host side of the pod's veth */
	__u8 mac[6];       /* the pod's interface */
	__u8 node_mac[6];  /* the host side, the pod's gateway */
};

/* The DNS proxy's transparent sockets (array, one element), written by the proxy process:
 * ports in host byte order, and the mark its policy-routing rule delivers locally. mark 0: no
 * proxy runs, and DNS of endpoints with DNS rules is dropped (fail closed). */
struct dns_proxy_config {
	__u16 udp_port;
	__u16 tcp_port;
	__u32 mark;
};

/* The HTTP proxy (array, one element), written by the proxy process. local_mark 0: no proxy
 * runs, and flows that policy sends to it are dropped (fail closed).
 * - Connections policy redirects are assigned to its transparent listeners, one per direction
 *   (the pod's egress, the pod's ingress), and marked local_mark, which its policy-routing
 *   rule delivers to this host.
 * - Its own connections carry a mark too (SO_MARK): those it makes on behalf of a client as
 *   upstream_egress_mark (judged by the destination's ingress policy as usual) or
 *   upstream_ingress_mark (already judged at L7: never redirected again), and its answers to
 *   the client downstream_mark. */
struct l7_proxy_config {
	__u16 egress_port;
	__u16 ingress_port;
	__u32 local_mark;
	__u32 upstream_egress_mark;
	__u32 upstream_ingress_mark;
	__u32 downstream_mark;
	__u32 pad;
};

/* Datapath-wide settings (array, one element). */
struct datapath_config {
	__u32 emit_allow_events;
	__u32 pad;
};

#endif /* CILIATE_H */
