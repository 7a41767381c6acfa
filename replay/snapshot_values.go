package replay

// Part of the snapshot reader (snapshot.go): reading its values.

import (
	"fmt"
	"math/big"
)

// Value accessors, with messages that name where in the snapshot a value
// is wrong.

func asList(v any, what string) ([]any, error) {
	switch l := v.(type) {
	case *pyList:
		return l.items, nil
	case pyTuple:
		return l, nil
	}
	return nil, fmt.Errorf("%s is a %s, not a list", what, pyTypeName(v))
}

func asDict(v any, what string) (*pyDict, error) {
	if d, ok := v.(*pyDict); ok {
		return d, nil
	}
	return nil, fmt.Errorf("%s is a %s, not a dict", what, pyTypeName(v))
}

// asUint is a non-negative int that fits in 64 bits.
func asUint(v any) (uint64, bool) {
	switch n := v.(type) {
	case int64:
		return uint64(n), n >= 0
	case *big.Int:
		return n.Uint64(), n.IsUint64()
	}
	return 0, false
}

func uintField(d *pyDict, key, what string) (uint64, error) {
	v, ok := d.get(key)
	if !ok {
		return 0, fmt.Errorf("%s has no %s", what, key)
	}
	n, ok := asUint(v)
	if !ok {
		return 0, fmt.Errorf("%s: %s is %s, not a non-negative integer", what, key, pyRepr(v))
	}
	return n, nil
}

// streamField reads a stream: torch writes the cudaStream_t as a signed
// int64, which the replay keeps as its 64 bits.
func streamField(d *pyDict, what string) (uint64, error) {
	v, ok := d.get("stream")
	if !ok {
		return 0, fmt.Errorf("%s has no stream", what)
	}
	if n, ok := v.(int64); ok {
		return uint64(n), nil
	}
	if n, ok := asUint(v); ok {
		return n, nil
	}
	return 0, fmt.Errorf("%s: stream is %s, not an integer", what, pyRepr(v))
}

// pyRepr shows a scalar for a message, or names a container's type.
func pyRepr(v any) string {
	switch x := v.(type) {
	case nil:
		return "None"
	case string:
		return preview(x)
	case *big.Int:
		// Decimal conversion takes time that grows faster than the
		// number's length: an int past 128 bits is named by its size.
		if n := x.BitLen(); n > 128 {
			if x.Sign() < 0 {
				return fmt.Sprintf("a negative int of %d bits", n)
			}
			return fmt.Sprintf("an int of %d bits", n)
		}
		return x.String()
	case int64, float64, bool:
		return fmt.Sprint(x)
	}
	return "a " + pyTypeName(v)
}
