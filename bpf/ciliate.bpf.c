// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * ciliate's datapath: identity-based L3/L4 policy on an endpoint's host-side veth.
 *
 *   from_container: tc ingress of the host veth = traffic the pod sends  = the pod's egress
 *   to_container:   tc egress  of the host veth = traffic the pod receives = the pod's ingress
 *
 * Per packet: parse (Ethernet, IPv4 with fragments handled conservatively, IPv6 with extension
 * headers, TCP/UDP/SCTP/ICMP/ICMPv6), connection tracking (replies and established flows of
 * allowed connections pass), the peer's identity from the ipcache (longest prefix match), then
 * the endpoint's policy map with wildcard fallbacks (exact identity or any, exact protocol or
 * any, every port prefix length in use), deny winning over allow. Counters per entry and per
 * reason; verdict events to a ring buffer.
 *
 * Every map is pinned by name under <bpf-root>/ciliate/: each endpoint's program instance shares
 * them, and they outlive the agent, so enforcement goes on while it restarts.
 *
 * ENDPOINT_ID is a read-only global set before load (the modern form of Cilium's ELF
 * substitution): each endpoint gets its own program instance. 0 means "not an endpoint".
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "ciliate.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

const volatile __u32 ENDPOINT_ID = 0;

#define IPPROTO_ICMPV6_ 58
#define IPPROTO_SCTP_ 132

struct policy_inner {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CILIATE_POLICY_MAP_MAX);
	__uint(key_size, sizeof(struct policy_key));
	__uint(value_size, sizeof(struct policy_value));
};

/* Instances that only exist so the skeleton generates Rust definitions of these types. */
struct policy_key _abi_policy_key = {};
struct ipcache_host_key _abi_ipcache_host_key = {};
struct policy_value _abi_policy_value = {};
struct verdict_event _abi_verdict_event = {};

/* Endpoint ids are 16-bit, so both per-endpoint tables are arrays indexed by the id: the
 * verifier inlines their lookups (no hashing), which a new connection's two lookups feel. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, CILIATE_ENDPOINTS_MAX);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct policy_inner);
} policy_maps SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, CILIATE_IPCACHE_MAX);
	__type(key, struct ipcache_key);
	__type(value, struct ipcache_value);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ipcache SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CILIATE_IPCACHE_MAX);
	__type(key, struct ipcache_host_key);
	__type(value, struct ipcache_value);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ipcache_hosts SEC(".maps");

/* A slot whose identity is 0 holds no endpoint. User space rewrites a record in place, so the
 * program may read a mix of an old and a new record's fields: the writer orders its updates
 * so that every such mix is safe (see sync_policy in datapath.rs). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CILIATE_ENDPOINTS_MAX);
	__type(key, __u32);
	__type(value, struct endpoint_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} endpoints SEC(".maps");

/* Conntrack, IPv4: a preallocated hash, not an LRU: an LRU insert rotates its lists and touches
 * many cold nodes (about 300 ns of a new connection's cost). Expiry is the agent's garbage
 * collector's job; a full table leaves new connections untracked (CILIATE_CT_FULL), never
 * allowed more. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CILIATE_CT_MAX);
	__type(key, struct ct4_key);
	__type(value, struct ct_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} conntrack4 SEC(".maps");

/* Conntrack, IPv6: allocated per entry, so a cluster without IPv6 pays no memory for it. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CILIATE_CT_MAX);
	__type(key, struct ct6_key);
	__type(value, struct ct_value);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} conntrack6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CILIATE_REASON_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} verdict_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, CILIATE_EVENTS_BYTES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct datapath_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} settings SEC(".maps");

/* What the parser extracted. Addresses are 16 bytes; IPv4 uses the first four. */
struct packet {
	__u8 saddr[16];
	__u8 daddr[16];
	__u16 sport;
	__u16 dport;
	__u16 policy_port; /* dport, or the ICMP type */
	__u8 protocol;
	__u8 family;
	__u8 l4_missing; /* a non-first fragment: no L4 header */
	__u8 tcp_flags;
};

#define TCP_FIN 0x01
#define TCP_RST 0x04
#define TCP_SYN 0x02
#define TCP_ACK 0x10

static __always_inline void count(__u32 reason)
{
	__u64 *c = bpf_map_lookup_elem(&verdict_counters, &reason);
	if (c)
		*c += 1;
}

/* Parses L4 at offset off. Returns 0 on success, -1 when the header is truncated. */
static __always_inline int parse_l4(struct __sk_buff *skb, __u32 off, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;

	if (p->l4_missing)
		return 0;
	switch (p->protocol) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP_: {
		__u16 *ports = data + off;
		if ((void *)(ports + 2) > end)
			return -1;
		p->sport = bpf_ntohs(ports[0]);
		p->dport = bpf_ntohs(ports[1]);
		p->policy_port = p->dport;
		/* The flags byte through a helper: clang merges a second direct bounds check with
		 * the one above in a way the verifier cannot follow. A header too short for flags
		 * leaves them 0 (decided without them). */
		if (p->protocol == IPPROTO_TCP)
			bpf_skb_load_bytes(skb, off + 13, &p->tcp_flags, 1);
		return 0;
	}
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6_: {
		__u8 *icmp = data + off;
		if ((void *)(icmp + 8) > end)
			return -1;
		__u8 type = icmp[0];
		__u16 id = ((__u16)icmp[4] << 8) | icmp[5];
		p->policy_port = type;
		/* Echo request: (id, 0); echo reply: (0, id). A reply's reversed tuple is the
		 * request's, so replies of allowed pings pass through conntrack. */
		int request = (p->protocol == IPPROTO_ICMP) ? type == 8 : type == 128;
		int reply = (p->protocol == IPPROTO_ICMP) ? type == 0 : type == 129;
		if (request) {
			p->sport = id;
			p->dport = 0;
		} else if (reply) {
			p->sport = 0;
			p->dport = id;
		} else {
			p->sport = 0;
			p->dport = type;
		}
		return 0;
	}
	default:
		return 0;
	}
}

/* Returns 0 for IP packets it parsed, 1 for packets that are not IP, -1 for malformed ones. */
static __always_inline int parse(struct __sk_buff *skb, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > end)
		return -1;
	__u16 proto = bpf_ntohs(eth->h_proto);
	__u32 off = sizeof(*eth);

	if (proto == ETH_P_IP) {
		struct iphdr *ip = data + off;
		if ((void *)(ip + 1) > end)
			return -1;
		if (ip->ihl < 5)
			return -1;
		p->family = 4;
		__builtin_memcpy(p->saddr, &ip->saddr, 4);
		__builtin_memcpy(p->daddr, &ip->daddr, 4);
		p->protocol = ip->protocol;
		__u16 frag = bpf_ntohs(ip->frag_off);
		/* A non-first fragment carries no ports: decide it on protocol-wide rules only. */
		if (frag & 0x1fff)
			p->l4_missing = 1;
		return parse_l4(skb, off + ip->ihl * 4, p);
	}
	if (proto == ETH_P_IPV6) {
		struct ipv6hdr *ip6 = data + off;
		if ((void *)(ip6 + 1) > end)
			return -1;
		p->family = 6;
		__builtin_memcpy(p->saddr, &ip6->saddr, 16);
		__builtin_memcpy(p->daddr, &ip6->daddr, 16);
		__u8 next = ip6->nexthdr;
		off += sizeof(*ip6);
		/* Walk a bounded number of extension headers. */
#pragma unroll
		for (int i = 0; i < 4; i++) {
			if (next == 0 || next == 43 || next == 60) { /* hop-by-hop, routing, dest opts */
				__u8 *h = data + off;
				if ((void *)(h + 2) > end)
					return -1;
				next = h[0];
				off += ((__u32)h[1] + 1) * 8;
			} else if (next == 44) { /* fragment */
				__u8 *h = data + off;
				if ((void *)(h + 8) > end)
					return -1;
				__u16 fo = ((__u16)h[2] << 8) | h[3];
				if (fo & 0xfff8)
					p->l4_missing = 1;
				next = h[0];
				off += 8;
			} else {
				break;
			}
		}
		p->protocol = next;
		return parse_l4(skb, off, p);
	}
	return 1;
}

static __always_inline __u32 peer_identity(struct packet *p, int egress)
{
	struct ipcache_host_key hk = {};
	hk.family = p->family;
	__builtin_memcpy(hk.addr, egress ? p->daddr : p->saddr, 16);
	struct ipcache_value *hv = bpf_map_lookup_elem(&ipcache_hosts, &hk);
	if (hv)
		return hv->identity;
	struct ipcache_key k = {};
	k.family = p->family;
	k.prefixlen = 32 + (p->family == 4 ? 32 : 128);
	__builtin_memcpy(k.addr, egress ? p->daddr : p->saddr, 16);
	struct ipcache_value *v = bpf_map_lookup_elem(&ipcache, &k);
	if (v)
		return v->identity;
	return p->family == 4 ? CILIATE_ID_WORLD_IPV4 : CILIATE_ID_WORLD_IPV6;
}

#define POLICY_NONE 0
#define POLICY_ALLOW 1
#define POLICY_DENY 2

/* Probes one policy entry; returns POLICY_DENY (and counts it) on a deny, remembers an allow. */
static __always_inline int probe(void *pmap, struct policy_key *k, struct policy_value **allow,
				 __u64 bytes)
{
	struct policy_value *v = bpf_map_lookup_elem(pmap, k);
	if (!v)
		return POLICY_NONE;
	if (v->deny) {
		__sync_fetch_and_add(&v->packets, 1);
		__sync_fetch_and_add(&v->bytes, bytes);
		return POLICY_DENY;
	}
	if (!*allow)
		*allow = v;
	return POLICY_ALLOW;
}

/* The number of set bits, without branches (BPF has no popcount instruction). */
static __always_inline __u32 popcount32(__u32 x)
{
	x = x - ((x >> 1) & 0x55555555);
	x = (x & 0x33333333) + ((x >> 2) & 0x33333333);
	x = (x + (x >> 4)) & 0x0f0f0f0f;
	return (x * 0x01010101) >> 24;
}

/* Deny-wins lookup: every entry that could match is probed (only the kinds the endpoint's
 * masks say exist); the first deny decides, else any allow. */
static __always_inline int policy_lookup(void *pmap, __u32 identity, __u8 egress, struct packet *p,
					 struct endpoint_info *info, __u64 bytes)
{
	struct policy_value *allow = 0;
	struct policy_key k = {};
	__u32 lens_id = info->port_prefix_lens, lens_any = info->any_identity_lens;
	if (!(info->flags & CILIATE_EP_SPLIT_LENS)) {
		lens_id |= CILIATE_LENS_ALL_PROTOCOLS;
		lens_any = lens_id;
	}
	k.egress = egress;

#pragma unroll
	for (int i = 0; i < 2; i++) {
		__u32 lens = i == 0 ? lens_id : lens_any;
		k.identity = i == 0 ? identity : 0;
		if (i == 1 && identity == 0)
			break;
		if (!lens)
			continue;
		if (lens & CILIATE_LENS_ALL_PROTOCOLS) {
			k.protocol = 0;
			k.port = 0;
			k.port_prefix_len = 0;
			if (probe(pmap, &k, &allow, bytes) == POLICY_DENY)
				return POLICY_DENY;
		}
		k.protocol = p->protocol;
		if (lens & 1) {
			k.port = 0;
			k.port_prefix_len = 0;
			if (probe(pmap, &k, &allow, bytes) == POLICY_DENY)
				return POLICY_DENY;
		}
		if (p->l4_missing)
			continue;
		/* One pass per port prefix length in use (a set bit), shortest first, not one
		 * per possible length: most endpoints use one or two. */
		__u32 ports = lens & 0x1fffe;
		for (int j = 0; j < 16 && ports; j++) {
			__u32 low = ports & -ports;
			ports ^= low;
			__u32 len = popcount32(low - 1);
			__u16 mask = (__u16)(0xffff0000u >> len);
			k.port = p->policy_port & mask;
			k.port_prefix_len = len;
			if (probe(pmap, &k, &allow, bytes) == POLICY_DENY)
				return POLICY_DENY;
		}
	}
	if (allow) {
		__sync_fetch_and_add(&allow->packets, 1);
		__sync_fetch_and_add(&allow->bytes, bytes);
		return POLICY_ALLOW;
	}
	return POLICY_NONE;
}

static __always_inline void emit(struct packet *p, __u32 ep, __u32 identity, int egress, __u32 reason)
{
	int is_drop = reason >= CILIATE_DROP_POLICY_DENY && reason <= CILIATE_DROP_MALFORMED;
	if (!is_drop) {
		__u32 zero = 0;
		struct datapath_config *c = bpf_map_lookup_elem(&settings, &zero);
		if (!c || !c->emit_allow_events)
			return;
	}
	struct verdict_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e)
		return;
	__builtin_memset(e, 0, sizeof(*e));
	e->timestamp_ns = bpf_ktime_get_ns();
	e->endpoint_id = ep;
	e->peer_identity = identity;
	e->egress = egress;
	e->protocol = p->protocol;
	e->port = p->policy_port;
	e->reason = reason;
	e->family = p->family;
	__builtin_memcpy(e->saddr, p->saddr, 16);
	__builtin_memcpy(e->daddr, p->daddr, 16);
	bpf_ringbuf_submit(e, 0);
}

/* The conntrack keys of a packet as it travels (reverse = 0), or of its reply (reverse = 1). */
static __always_inline void ct4_tuple(struct ct4_key *k, struct packet *p, __u32 ep, int reverse)
{
	__builtin_memset(k, 0, sizeof(*k));
	__builtin_memcpy(k->saddr, reverse ? p->daddr : p->saddr, 4);
	__builtin_memcpy(k->daddr, reverse ? p->saddr : p->daddr, 4);
	k->sport = reverse ? p->dport : p->sport;
	k->dport = reverse ? p->sport : p->dport;
	k->protocol = p->protocol;
	k->endpoint_id = ep;
}

static __always_inline void ct6_tuple(struct ct6_key *k, struct packet *p, __u32 ep, int reverse)
{
	__builtin_memset(k, 0, sizeof(*k));
	__builtin_memcpy(k->saddr, reverse ? p->daddr : p->saddr, 16);
	__builtin_memcpy(k->daddr, reverse ? p->saddr : p->daddr, 16);
	k->sport = reverse ? p->dport : p->sport;
	k->dport = reverse ? p->sport : p->dport;
	k->protocol = p->protocol;
	k->family = 6;
	k->endpoint_id = ep;
}

/* The entry of the packet's tuple (reverse = 0) or of its reply's (reverse = 1). */
static __always_inline struct ct_value *ct_lookup(struct packet *p, __u32 ep, int reverse)
{
	if (p->family == 4) {
		struct ct4_key k;
		ct4_tuple(&k, p, ep, reverse);
		return bpf_map_lookup_elem(&conntrack4, &k);
	}
	struct ct6_key k;
	ct6_tuple(&k, p, ep, reverse);
	return bpf_map_lookup_elem(&conntrack6, &k);
}

/* Tracks the packet's tuple (replacing any entry it had); non-zero when the table is full. */
static __always_inline long ct_create(struct packet *p, __u32 ep, struct ct_value *v)
{
	if (p->family == 4) {
		struct ct4_key k;
		ct4_tuple(&k, p, ep, 0);
		return bpf_map_update_elem(&conntrack4, &k, v, BPF_ANY);
	}
	struct ct6_key k;
	ct6_tuple(&k, p, ep, 0);
	return bpf_map_update_elem(&conntrack6, &k, v, BPF_ANY);
}

static __always_inline int decide(struct __sk_buff *skb, int egress)
{
	__u32 ep = ENDPOINT_ID;
	if (ep == 0) {
		count(CILIATE_PASS_UNMANAGED);
		return TC_ACT_OK;
	}
	struct endpoint_info *info = bpf_map_lookup_elem(&endpoints, &ep);
	if (!info || !info->identity) {
		/* Attached but not (or no longer) known: fail closed. */
		count(CILIATE_DROP_NOT_REALIZED);
		return TC_ACT_SHOT;
	}
	struct packet p = {};
	int r = parse(skb, &p);
	if (r == 1) {
		count(CILIATE_PASS_NOT_IP);
		return TC_ACT_OK;
	}
	if (r < 0) {
		count(CILIATE_DROP_MALFORMED);
		emit(&p, ep, 0, egress, CILIATE_DROP_MALFORMED);
		return TC_ACT_SHOT;
	}
	/* IPv6 link control, handled before policy as Cilium does: neighbour discovery (router and
	 * neighbour solicitation/advertisement, redirect: 133-137) and multicast listener
	 * messages (130-132, 143). Without them a pod has no IPv6 at all. */
	if (p.protocol == IPPROTO_ICMPV6_ && !p.l4_missing &&
	    ((p.policy_port >= 130 && p.policy_port <= 137) || p.policy_port == 143)) {
		count(CILIATE_PASS_NOT_IP);
		return TC_ACT_OK;
	}
	if (info->flags & CILIATE_EP_DROP_ALL) {
		count(CILIATE_DROP_NOT_REALIZED);
		emit(&p, ep, 0, egress, CILIATE_DROP_NOT_REALIZED);
		return TC_ACT_SHOT;
	}

	/* Conntrack: the tuple as seen from the endpoint's side of this packet. */
	/* CLOCK_MONOTONIC at tick resolution: it reads the timekeeper's last tick instead of the
	 * clocksource (in a VM a paravirtual clock read), and a few milliseconds are nothing
	 * against conntrack timeouts of seconds. */
	__u64 now = bpf_ktime_get_coarse_ns();
	__u8 closing = p.protocol == IPPROTO_TCP && (p.tcp_flags & (TCP_FIN | TCP_RST));
	/* A TCP SYN without ACK opens a connection: it is never part of a tracked flow in either
	 * direction, so it skips both probes and always meets the policy in force (a retransmitted
	 * SYN too, and a simultaneous open); when allowed, its entry replaces any older one. */
	__u8 opening = p.protocol == IPPROTO_TCP && !p.l4_missing &&
		       (p.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
	struct ct_value *ct = opening ? 0 : ct_lookup(&p, ep, 0);
	if (ct && ct->egress == egress) {
		ct->last_seen_ns = now;
		if (closing && !ct->closing)
			ct->closing = 1;
		__sync_fetch_and_add(&ct->packets, 1);
		count(CILIATE_ALLOW_ESTABLISHED);
		return TC_ACT_OK;
	}
	ct = opening ? 0 : ct_lookup(&p, ep, 1);
	if (ct && ct->egress != egress) {
		ct->last_seen_ns = now;
		if (!ct->replied)
			ct->replied = 1;
		if (closing && !ct->closing)
			ct->closing = 1;
		__sync_fetch_and_add(&ct->packets, 1);
		count(CILIATE_ALLOW_REPLY);
		return TC_ACT_OK;
	}

	__u32 identity = peer_identity(&p, egress);
	__u32 reason;
	void *pmap = bpf_map_lookup_elem(&policy_maps, &ep);
	int verdict = POLICY_NONE;
	if (pmap)
		verdict = policy_lookup(pmap, identity, egress, &p, info, skb->len);
	if (verdict == POLICY_DENY) {
		reason = CILIATE_DROP_POLICY_DENY;
	} else if (verdict == POLICY_ALLOW) {
		reason = CILIATE_ALLOW_POLICY;
	} else {
		__u32 isolated = egress ? (info->flags & CILIATE_EP_EGRESS_DEFAULT_DENY)
					: (info->flags & CILIATE_EP_INGRESS_DEFAULT_DENY);
		reason = isolated ? CILIATE_DROP_DEFAULT_DENY : CILIATE_ALLOW_NOT_ISOLATED;
	}
	count(reason);
	emit(&p, ep, identity, egress, reason);
	if (reason == CILIATE_DROP_POLICY_DENY || reason == CILIATE_DROP_DEFAULT_DENY)
		return TC_ACT_SHOT;

	struct ct_value nv = {};
	nv.last_seen_ns = now;
	nv.packets = 1;
	nv.egress = egress;
	nv.closing = closing;
	if (ct_create(&p, ep, &nv))
		count(CILIATE_CT_FULL);
	return TC_ACT_OK;
}

SEC("tc")
int from_container(struct __sk_buff *skb)
{
	return decide(skb, 1);
}

SEC("tc")
int to_container(struct __sk_buff *skb)
{
	return decide(skb, 0);
}
