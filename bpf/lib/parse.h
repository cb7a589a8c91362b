// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Packet parsing: Ethernet, then IPv4 (lib/ipv4.h) or IPv6 (lib/ipv6.h), then
 * TCP/UDP/SCTP/ICMP/ICMPv6, into a struct packet. */
#ifndef CILIATE_LIB_PARSE_H
#define CILIATE_LIB_PARSE_H

#define IPPROTO_ICMPV6_ 58
#define IPPROTO_SCTP_ 132

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

/* Parses L4 at offset off. Returns 0 on success, -1 when the header is truncated. */
static __always_inline int parse_l4(struct __sk_buff *skb, __u32 off, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;

	if (p->l4_missing)
		return 0;
	switch (p->protocol) {
	case IPPROTO_TCP: {
		/* Ports and the flags byte (offset 13) under one bounds check: a TCP header too
		 * short to hold its flags is malformed. */
		__u8 *tcp = data + off;
		if ((void *)(tcp + 14) > end)
			return -1;
		p->sport = ((__u16)tcp[0] << 8) | tcp[1];
		p->dport = ((__u16)tcp[2] << 8) | tcp[3];
		p->policy_port = p->dport;
		p->tcp_flags = tcp[13];
		return 0;
	}
	case IPPROTO_UDP:
	case IPPROTO_SCTP_: {
		__u16 *ports = data + off;
		if ((void *)(ports + 2) > end)
			return -1;
		p->sport = bpf_ntohs(ports[0]);
		p->dport = bpf_ntohs(ports[1]);
		p->policy_port = p->dport;
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

/* Per family (each header parses its network header and calls parse_l4). */
#include "ipv4.h"
#include "ipv6.h"

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

	if (proto == ETH_P_IP)
		return parse_ipv4(skb, off, p);
	if (proto == ETH_P_IPV6)
		return parse_ipv6(skb, off, p);
	return 1;
}

#endif /* CILIATE_LIB_PARSE_H */
