// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Connection tracking: per-family tuples, lookups and inserts (replies and established flows
 * of allowed connections pass). */
#ifndef CILIATE_LIB_CONNTRACK_H
#define CILIATE_LIB_CONNTRACK_H

/* The conntrack key of a packet as it travels (reverse = 0), or of its reply (reverse = 1):
 * the same fields for both families, addresses of `alen` bytes. */
#define CT_TUPLE(k, p, ep, reverse, alen)                                      \
	do {                                                                   \
		__builtin_memset(k, 0, sizeof(*(k)));                          \
		__builtin_memcpy((k)->saddr, reverse ? (p)->daddr : (p)->saddr, alen); \
		__builtin_memcpy((k)->daddr, reverse ? (p)->saddr : (p)->daddr, alen); \
		(k)->sport = reverse ? (p)->dport : (p)->sport;                \
		(k)->dport = reverse ? (p)->sport : (p)->dport;                \
		(k)->protocol = (p)->protocol;                                 \
		(k)->endpoint_id = ep;                                         \
	} while (0)

static __always_inline void ct4_tuple(struct ct4_key *k, struct packet *p, __u32 ep, int reverse)
{
	CT_TUPLE(k, p, ep, reverse, 4);
}

static __always_inline void ct6_tuple(struct ct6_key *k, struct packet *p, __u32 ep, int reverse)
{
	CT_TUPLE(k, p, ep, reverse, 16);
	k->family = 6;
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

/* Whether an IPv4 ICMP error (destination unreachable, time exceeded, parameter problem)
 * is about a connection endpoint `ep` tracks: the packet it quotes, as it was sent or the
 * other way round, is one of its entries (Cilium's related traffic: a "fragmentation needed"
 * for a connection is path MTU discovery, not a new flow). Headers with IP options are not
 * looked into. A global function: verified once, on its own. */
__attribute__((noinline)) int ciliate_related_icmp4(struct __sk_buff *skb, __u32 ep)
{
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = ipv4_header(skb);
	if (!ip || ip->protocol != IPPROTO_ICMP || ip->ihl != 5)
		return 0;
	__u8 *icmp = (void *)(ip + 1);
	if ((void *)(icmp + 8) > end || (icmp[0] != 3 && icmp[0] != 11 && icmp[0] != 12))
		return 0;
	struct iphdr *in = (void *)(icmp + 8);
	if ((void *)(in + 1) > end || in->ihl != 5)
		return 0;
	__u8 proto = in->protocol;
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP_)
		return 0;
	__u16 *ports = (void *)(in + 1);
	if ((void *)(ports + 2) > end)
		return 0;
	struct packet q = {};
	q.family = 4;
	q.protocol = proto;
	__builtin_memcpy(q.saddr, &in->saddr, 4);
	__builtin_memcpy(q.daddr, &in->daddr, 4);
	q.sport = bpf_ntohs(ports[0]);
	q.dport = bpf_ntohs(ports[1]);
	return ct_lookup(&q, ep, 0) || ct_lookup(&q, ep, 1);
}

#endif /* CILIATE_LIB_CONNTRACK_H */
