// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* IPv4: the header after Ethernet, and a packet's addresses, protocol and ports (fragments
 * handled conservatively). Cilium's lib/ipv4.h; lib/ipv6.h is its IPv6 counterpart. */
#ifndef CILIATE_LIB_IPV4_H
#define CILIATE_LIB_IPV4_H

/* The IPv4 header after the Ethernet header, or 0 (not IPv4, or cut short). */
static __always_inline struct iphdr *ipv4_header(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return 0;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return 0;
	return ip;
}

/* Parses the IPv4 header at offset `off` and what follows it. Returns 0, or -1 when
 * malformed. */
static __always_inline int parse_ipv4(struct __sk_buff *skb, __u32 off, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
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

#endif /* CILIATE_LIB_IPV4_H */
