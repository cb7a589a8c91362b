// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The shape of every map both programs pin by name under the agent's bpffs directory. */
#ifndef CILIATE_LIB_PINNED_H
#define CILIATE_LIB_PINNED_H

/* A map pinned by name: `_flags` is 0 or BPF_F_NO_PREALLOC (the pinned map of an earlier run
 * is reused only when type, sizes, entries and flags all match). */
#define PINNED_MAP(_type, _max, _key, _value, _flags) \
	struct {                                      \
		__uint(type, _type);                  \
		__uint(max_entries, _max);            \
		__type(key, _key);                    \
		__type(value, _value);                \
		__uint(map_flags, _flags);            \
		__uint(pinning, LIBBPF_PIN_BY_NAME);  \
	}

/* A per-CPU counter: one slot, summed by the agent. */
#define PINNED_COUNTER(_slots) PINNED_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, _slots, __u32, __u64, 0)

#endif /* CILIATE_LIB_PINNED_H */
