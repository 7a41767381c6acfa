package reference

// ordered is a set of two-field keys (k1, k2), ordered by k1 then k2, each
// with a value. It is the index best fit needs: keyed by (size, address), the
// smallest free piece of at least n bytes, lowest address first, is
// ceil(n, 0). The standard library has no ordered map, and a sorted slice
// costs a memmove of the whole index per insert once a pool holds thousands
// of free pieces, so this is a treap: a binary search tree on the keys that
// is also a max-heap on random priorities, O(log n) expected per operation.
//
// No result depends on the tree's shape, only on the keys, so the replay is
// deterministic whatever the priorities; they come from a fixed-seed
// generator all the same, so that timings repeat too.
type ordered[V any] struct {
	root  *onode[V]
	len   int
	rng   uint64
	spare *onode[V] // freed nodes, linked through right, reused before allocating
}

type onode[V any] struct {
	k1, k2      uint64
	val         V
	prio        uint64
	left, right *onode[V]
}

// keyLess says whether (a1, a2) sorts before (b1, b2).
func keyLess(a1, a2, b1, b2 uint64) bool { return a1 < b1 || (a1 == b1 && a2 < b2) }

// next is splitmix64: cheap, and good enough for treap priorities.
func (t *ordered[V]) next() uint64 {
	t.rng += 0x9e3779b97f4a7c15
	z := t.rng
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// insert adds (k1, k2) with value v. The key must not be in the set.
func (t *ordered[V]) insert(k1, k2 uint64, v V) {
	n := t.spare
	if n != nil {
		t.spare = n.right
		n.right = nil
	} else {
		n = new(onode[V])
	}
	n.k1, n.k2, n.val, n.prio = k1, k2, v, t.next()
	// Walk down to where n belongs in the heap order, then split the subtree
	// there around n's key to give n its children.
	p := &t.root
	for *p != nil && (*p).prio > n.prio {
		if keyLess(k1, k2, (*p).k1, (*p).k2) {
			p = &(*p).left
		} else {
			p = &(*p).right
		}
	}
	n.left, n.right = split(*p, k1, k2)
	*p = n
	t.len++
}

// split cuts the tree n into the keys before (k1, k2) and the rest.
func split[V any](n *onode[V], k1, k2 uint64) (lo, hi *onode[V]) {
	if n == nil {
		return nil, nil
	}
	if keyLess(n.k1, n.k2, k1, k2) {
		n.right, hi = split(n.right, k1, k2)
		return n, hi
	}
	lo, n.left = split(n.left, k1, k2)
	return lo, n
}

// merge joins two trees, every key of a sorting before every key of b.
func merge[V any](a, b *onode[V]) *onode[V] {
	switch {
	case a == nil:
		return b
	case b == nil:
		return a
	case a.prio > b.prio:
		a.right = merge(a.right, b)
		return a
	default:
		b.left = merge(a, b.left)
		return b
	}
}

// remove deletes (k1, k2) and says whether it was there.
func (t *ordered[V]) remove(k1, k2 uint64) bool {
	p := &t.root
	for n := *p; n != nil; n = *p {
		switch {
		case n.k1 == k1 && n.k2 == k2:
			*p = merge(n.left, n.right)
			var zero V
			n.val, n.left, n.right = zero, nil, t.spare
			t.spare = n
			t.len--
			return true
		case keyLess(k1, k2, n.k1, n.k2):
			p = &n.left
		default:
			p = &n.right
		}
	}
	return false
}

// ceil returns the node with the smallest key at or after (k1, k2), or nil.
func (t *ordered[V]) ceil(k1, k2 uint64) *onode[V] {
	var best *onode[V]
	for n := t.root; n != nil; {
		if keyLess(n.k1, n.k2, k1, k2) {
			n = n.right
		} else {
			best, n = n, n.left
		}
	}
	return best
}

// each calls f on every entry in key order. f must not change the set.
func (t *ordered[V]) each(f func(k1, k2 uint64, v V)) {
	var walk func(n *onode[V])
	walk = func(n *onode[V]) {
		for n != nil {
			walk(n.left)
			f(n.k1, n.k2, n.val)
			n = n.right
		}
	}
	walk(t.root)
}
