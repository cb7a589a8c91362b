// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* IPv6: a packet's addresses, protocol (past a bounded number of extension headers) and
 * ports. Cilium's lib/ipv6.h; lib/ipv4.h is its IPv4 counterpart. */
#ifndef CILIATE_LIB_IPV6_H
#define CILIATE_LIB_IPV6_H

/* Parses the IPv6 header at offset `off`, its extension headers and what follows them.
 * Returns 0, or -1 when malformed. */
static __always_inline int parse_ipv6(struct __sk_buff *skb, __u32 off, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
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

#endif /* CILIATE_LIB_IPV6_H */
