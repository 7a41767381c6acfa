package replay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/big"
)

// This file is a minimal unpickler: enough of Python's pickle format to read
// what torch.cuda.memory._dump_snapshot writes, which is pickle.dump of a
// tree of dicts, lists, tuples, strings, ints, floats, bools and None.
//
// Why a reader of our own: no pickle reader exists in the standard library,
// and the ones outside it decode far more than plain data (class
// instances, REDUCE calls), which is both more code than this file and the
// part of pickle that makes a foreign file dangerous to load. This one
// builds nothing but data: every opcode that would name a Python class or
// call a function (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, NEWOBJ, INST, OBJ,
// PERSID, EXT) is an error that says so, and so are the text opcodes of
// protocol 0, which Python 3 never writes unless asked. What it reads is
// every opcode that Python's pickler (protocols 2 to 5, the default being 4
// on Python 3.8-3.13 and 5 from 3.14) and torch's C++ pickler emit for those
// types, with the memo, frames, sets and bytes besides.
//
// Values come out as Go values:
//
//	None -> nil, bool -> bool, int -> int64 (or *big.Int beyond 64 bits),
//	float -> float64, str -> string, bytes/bytearray -> []byte,
//	list and set -> *pyList, tuple and frozenset -> pyTuple, dict -> *pyDict
//
// Lists and dicts are pointers because the memo can hand out the same one
// twice, and a list may be filled (APPENDS) after it was memoized.

// pickleProto is the PROTO opcode, the first byte of every pickle of
// protocol 2 or later: what tells a snapshot from a JSON lines trace.
const pickleProto = 0x80

// pyList is a Python list (or set).
type pyList struct{ items []any }

// pyTuple is a Python tuple (or frozenset).
type pyTuple []any

// pyDict is a Python dict with its insertion order. Snapshot dicts are
// small, so lookups scan; a dict that grows large gets an index.
type pyDict struct {
	keys, vals []any
	index      map[any]int
}

// dictIndexFrom is the size from which a pyDict keeps a map from key to
// position, so that filling a large dict is not quadratic.
const dictIndexFrom = 16

// maxKeyBytes bounds a str key. Every SETITEM hashes its key, or compares it
// with up to dictIndexFrom others, and the memo lets a two-byte reference
// set a long key again, so a key's length multiplies the work a small file
// can ask for. A snapshot's keys are field and setting names, far shorter.
const maxKeyBytes = 255

// get returns the value under the string key.
func (d *pyDict) get(key string) (any, bool) {
	if d.index != nil {
		i, ok := d.index[key]
		if !ok {
			return nil, false
		}
		return d.vals[i], true
	}
	for i, k := range d.keys {
		if s, ok := k.(string); ok && s == key {
			return d.vals[i], true
		}
	}
	return nil, false
}

// set stores v under k, replacing an earlier value, as Python does.
func (d *pyDict) set(k, v any) error {
	switch k := k.(type) {
	case string:
		if len(k) > maxKeyBytes {
			return fmt.Errorf("a dict key of %d bytes, %s (a snapshot's keys are names; this reader takes keys of up to %d bytes)", len(k), preview(k), maxKeyBytes)
		}
	case nil, bool, int64, float64:
	default:
		return fmt.Errorf("a dict key of type %s (only None, bool, int, float and str keys are read)", pyTypeName(k))
	}
	if d.index != nil {
		if i, ok := d.index[k]; ok {
			d.vals[i] = v
			return nil
		}
	} else {
		for i, old := range d.keys {
			if old == k {
				d.vals[i] = v
				return nil
			}
		}
	}
	d.keys = append(d.keys, k)
	d.vals = append(d.vals, v)
	switch {
	case d.index != nil:
		d.index[k] = len(d.keys) - 1
	case len(d.keys) >= dictIndexFrom:
		d.index = make(map[any]int, 2*len(d.keys))
		for i, k := range d.keys {
			d.index[k] = i
		}
	}
	return nil
}

// pyTypeName names a decoded value's Python type, for messages.
func pyTypeName(v any) string {
	switch v.(type) {
	case nil:
		return "None"
	case bool:
		return "bool"
	case int64, *big.Int:
		return "int"
	case float64:
		return "float"
	case string:
		return "str"
	case []byte:
		return "bytes"
	case *pyList:
		return "list"
	case pyTuple:
		return "tuple"
	case *pyDict:
		return "dict"
	}
	return fmt.Sprintf("%T", v)
}

// PickleError is a pickle this reader cannot decode, at a byte offset.
type PickleError struct {
	Offset int
	Err    error
}

func (e *PickleError) Error() string { return fmt.Sprintf("pickle: at byte %d: %v", e.Offset, e.Err) }

func (e *PickleError) Unwrap() error { return e.Err }

// errPickleTruncated is input that ends before STOP.
var errPickleTruncated = errors.New("the data ends before the pickle does (truncated file?)")

// unpickler decodes one pickle from a byte slice.
type unpickler struct {
	data  []byte
	pos   int
	stack []any
	marks []int // stack heights at each MARK
	memo  []any
}

// unpickle decodes the pickle at the start of data and returns its value.
// Bytes after the STOP opcode are ignored, as Python's pickle.load does.
func unpickle(data []byte) (any, error) {
	u := &unpickler{data: data}
	v, err := u.run()
	if err != nil {
		return nil, &PickleError{Offset: u.pos, Err: err}
	}
	return v, nil
}

// The opcodes, named as in Python's pickletools.
const (
	opMark            = '('
	opStop            = '.'
	opPop             = '0'
	opPopMark         = '1'
	opDup             = '2'
	opBinint          = 'J'
	opBinint1         = 'K'
	opBinint2         = 'M'
	opNone            = 'N'
	opBinstring       = 'T'
	opShortBinstring  = 'U'
	opBinunicode      = 'X'
	opAppend          = 'a'
	opDict            = 'd'
	opEmptyDict       = '}'
	opAppends         = 'e'
	opBinget          = 'h'
	opLongBinget      = 'j'
	opList            = 'l'
	opEmptyList       = ']'
	opBinput          = 'q'
	opLongBinput      = 'r'
	opSetitem         = 's'
	opTuple           = 't'
	opEmptyTuple      = ')'
	opSetitems        = 'u'
	opBinfloat        = 'G'
	opBinbytes        = 'B'
	opShortBinbytes   = 'C'
	opTuple1          = 0x85
	opTuple2          = 0x86
	opTuple3          = 0x87
	opNewtrue         = 0x88
	opNewfalse        = 0x89
	opLong1           = 0x8a
	opLong4           = 0x8b
	opShortBinunicode = 0x8c
	opBinunicode8     = 0x8d
	opBinbytes8       = 0x8e
	opEmptySet        = 0x8f
	opAdditems        = 0x90
	opFrozenset       = 0x91
	opMemoize         = 0x94
	opFrame           = 0x95
	opBytearray8      = 0x96
)

// objectOpcodes are the opcodes that build class instances or call
// functions, with their names for the error message.
var objectOpcodes = map[byte]string{
	'c': "GLOBAL", 0x93: "STACK_GLOBAL", 'R': "REDUCE", 'b': "BUILD", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX",
	'i': "INST", 'o': "OBJ", 'P': "PERSID", 'Q': "BINPERSID", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4",
	0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}

// textOpcodes are protocol 0's, which write values as text.
var textOpcodes = map[byte]string{
	'I': "INT", 'L': "LONG", 'F': "FLOAT", 'S': "STRING", 'V': "UNICODE", 'g': "GET", 'p': "PUT",
}

func (u *unpickler) run() (any, error) {
	for {
		if u.pos >= len(u.data) {
			return nil, errPickleTruncated
		}
		op := u.data[u.pos]
		u.pos++
		if op == opStop {
			if len(u.stack) != 1 || len(u.marks) != 0 {
				return nil, fmt.Errorf("STOP with %d values and %d marks on the stack (want one value, no mark)", len(u.stack), len(u.marks))
			}
			return u.stack[0], nil
		}
		taken, err := u.step(op)
		if err != nil {
			return nil, err
		}
		if !taken {
			u.pos--
			return nil, refusal(op)
		}
	}
}

// step carries out op, and says whether this reader takes it at all.
func (u *unpickler) step(op byte) (bool, error) {
	if ok, err := u.framingOp(op); ok {
		return true, err
	}
	if ok, err := u.stackOp(op); ok {
		return true, err
	}
	if ok, err := u.scalarOp(op); ok {
		return true, err
	}
	if ok, err := u.textOp(op); ok {
		return true, err
	}
	if ok, err := u.containerOp(op); ok {
		return true, err
	}
	return u.memoOp(op)
}

// refusal says why an opcode the reader does not take is refused.
func refusal(op byte) error {
	if name, ok := objectOpcodes[op]; ok {
		return fmt.Errorf("opcode %s (%#02x) makes a Python object or calls a function; a memory snapshot is plain data (dicts, lists, str, int, float), and this reader builds nothing else", name, op)
	}
	if name, ok := textOpcodes[op]; ok {
		return fmt.Errorf("opcode %s (%#02x) of text protocol 0; write the pickle with protocol 2 or later (pickle.dump's default)", name, op)
	}
	return fmt.Errorf("unknown opcode %#02x (not a pickle, or a damaged one)", op)
}

// framingOp carries out the protocol and framing opcodes.
func (u *unpickler) framingOp(op byte) (bool, error) {
	var err error
	switch op {
	case pickleProto:
		var b []byte
		if b, err = u.take(1); err == nil && b[0] > 5 {
			err = fmt.Errorf("pickle protocol %d (this reader knows 2 to 5)", b[0])
		}
	case opFrame:
		// Frames only group opcodes for buffered reading; the whole
		// pickle is in memory already.
		_, err = u.take(8)
	default:
		return false, nil
	}
	return true, err
}

// stackOp carries out the opcodes that move values on the stack.
func (u *unpickler) stackOp(op byte) (bool, error) {
	var err error
	switch op {
	case opMark:
		u.marks = append(u.marks, len(u.stack))
	case opPop:
		// With nothing above the innermost mark, POP drops the mark,
		// as Python's unpickler does.
		switch {
		case len(u.stack) > u.floor():
			u.stack = u.stack[:len(u.stack)-1]
		case len(u.marks) > 0:
			u.marks = u.marks[:len(u.marks)-1]
		default:
			return true, errors.New("POP on an empty stack")
		}
	case opPopMark:
		_, err = u.popMark()
	case opDup:
		if len(u.stack) == u.floor() {
			return true, errors.New("DUP on an empty stack")
		}
		u.push(u.stack[len(u.stack)-1])
	default:
		return false, nil
	}
	return true, err
}

// scalarOp pushes None, booleans, integers and floats.
func (u *unpickler) scalarOp(op byte) (bool, error) {
	var err error
	switch op {
	case opNone:
		u.push(nil)
	case opNewtrue:
		u.push(true)
	case opNewfalse:
		u.push(false)
	case opBinint:
		var b []byte
		if b, err = u.take(4); err == nil {
			u.push(int64(int32(binary.LittleEndian.Uint32(b))))
		}
	case opBinint1:
		var b []byte
		if b, err = u.take(1); err == nil {
			u.push(int64(b[0]))
		}
	case opBinint2:
		var b []byte
		if b, err = u.take(2); err == nil {
			u.push(int64(binary.LittleEndian.Uint16(b)))
		}
	case opLong1:
		var b []byte
		if b, err = u.take(1); err == nil {
			err = u.long(int(b[0]))
		}
	case opLong4:
		var n int
		if n, err = u.length(4, "LONG4"); err == nil {
			err = u.long(n)
		}
	case opBinfloat:
		var b []byte
		if b, err = u.take(8); err == nil {
			u.push(math.Float64frombits(binary.BigEndian.Uint64(b)))
		}
	default:
		return false, nil
	}
	return true, err
}

// textOp pushes strings and bytes.
func (u *unpickler) textOp(op byte) (bool, error) {
	var err error
	switch op {
	case opShortBinunicode:
		err = u.str(1, "SHORT_BINUNICODE", true)
	case opBinunicode:
		err = u.str(4, "BINUNICODE", true)
	case opBinunicode8:
		err = u.str(8, "BINUNICODE8", true)
	case opShortBinstring:
		// Python 2's str: bytes that Python 3 reads as text (its
		// default encoding="ASCII"; latin-1 is the lenient reading).
		err = u.str(1, "SHORT_BINSTRING", false)
	case opBinstring:
		err = u.str(4, "BINSTRING", false)
	case opShortBinbytes:
		err = u.bytes(1, "SHORT_BINBYTES")
	case opBinbytes:
		err = u.bytes(4, "BINBYTES")
	case opBinbytes8:
		err = u.bytes(8, "BINBYTES8")
	case opBytearray8:
		err = u.bytes(8, "BYTEARRAY8")
	default:
		return false, nil
	}
	return true, err
}

// containerOp builds lists, tuples and dicts.
func (u *unpickler) containerOp(op byte) (bool, error) {
	var err error
	switch op {
	case opEmptyList:
		u.push(&pyList{})
	case opEmptySet:
		u.push(&pyList{})
	case opList:
		var items []any
		if items, err = u.popMark(); err == nil {
			u.push(&pyList{items: items})
		}
	case opAppend:
		err = u.appendItems(1)
	case opAppends, opAdditems:
		err = u.appendMarked()
	case opEmptyTuple:
		u.push(pyTuple{})
	case opTuple1, opTuple2, opTuple3:
		n := int(op-opTuple1) + 1
		if len(u.stack)-u.floor() < n {
			return true, fmt.Errorf("TUPLE%d with fewer than %d values on the stack", n, n)
		}
		t := append(pyTuple(nil), u.stack[len(u.stack)-n:]...)
		u.stack = u.stack[:len(u.stack)-n]
		u.push(t)
	case opTuple, opFrozenset:
		var items []any
		if items, err = u.popMark(); err == nil {
			u.push(pyTuple(items))
		}
	case opEmptyDict:
		u.push(&pyDict{})
	case opDict:
		var items []any
		if items, err = u.popMark(); err == nil {
			d := &pyDict{}
			err = setPairs(d, items)
			u.push(d)
		}
	case opSetitem:
		if len(u.stack)-u.floor() < 3 {
			return true, errors.New("SETITEM without a dict, a key and a value on the stack")
		}
		n := len(u.stack)
		d, ok := u.stack[n-3].(*pyDict)
		if !ok {
			return true, fmt.Errorf("SETITEM on a %s, not a dict", pyTypeName(u.stack[n-3]))
		}
		err = d.set(u.stack[n-2], u.stack[n-1])
		u.stack = u.stack[:n-2]
	case opSetitems:
		var items []any
		if items, err = u.popMarkView(); err != nil {
			break
		}
		if len(u.stack) == u.floor() {
			return true, errors.New("SETITEMS without a dict on the stack")
		}
		d, ok := u.stack[len(u.stack)-1].(*pyDict)
		if !ok {
			return true, fmt.Errorf("SETITEMS on a %s, not a dict", pyTypeName(u.stack[len(u.stack)-1]))
		}
		err = setPairs(d, items)
	default:
		return false, nil
	}
	return true, err
}

// memoOp stores values in the memo and fetches them back.
func (u *unpickler) memoOp(op byte) (bool, error) {
	var err error
	switch op {
	case opMemoize:
		if len(u.stack) == u.floor() {
			return true, errors.New("MEMOIZE on an empty stack")
		}
		err = u.put(uint64(len(u.memo)))
	case opBinput:
		var b []byte
		if b, err = u.take(1); err == nil {
			err = u.put(uint64(b[0]))
		}
	case opLongBinput:
		var b []byte
		if b, err = u.take(4); err == nil {
			err = u.put(uint64(binary.LittleEndian.Uint32(b)))
		}
	case opBinget:
		var b []byte
		if b, err = u.take(1); err == nil {
			err = u.get(uint64(b[0]))
		}
	case opLongBinget:
		var b []byte
		if b, err = u.take(4); err == nil {
			err = u.get(uint64(binary.LittleEndian.Uint32(b)))
		}
	default:
		return false, nil
	}
	return true, err
}

func (u *unpickler) push(v any) { u.stack = append(u.stack, v) }

// floor is the stack height below which the innermost MARK hides values.
func (u *unpickler) floor() int {
	if n := len(u.marks); n > 0 {
		return u.marks[n-1]
	}
	return 0
}

// take returns the next n bytes of the data.
func (u *unpickler) take(n int) ([]byte, error) {
	if n < 0 || n > len(u.data)-u.pos {
		return nil, errPickleTruncated
	}
	b := u.data[u.pos : u.pos+n]
	u.pos += n
	return b, nil
}

// length reads a little-endian length of size bytes and checks that that
// many bytes follow: a damaged length fails here, before any allocation.
func (u *unpickler) length(size int, what string) (int, error) {
	b, err := u.take(size)
	if err != nil {
		return 0, err
	}
	var n uint64
	switch size {
	case 1:
		n = uint64(b[0])
	case 4:
		n = uint64(binary.LittleEndian.Uint32(b))
	case 8:
		n = binary.LittleEndian.Uint64(b)
	}
	if n > uint64(len(u.data)-u.pos) {
		return 0, fmt.Errorf("%s of %d bytes, but only %d bytes follow (truncated file?)", what, n, len(u.data)-u.pos)
	}
	return int(n), nil
}

func (u *unpickler) str(size int, what string, utf bool) error {
	n, err := u.length(size, what)
	if err != nil {
		return err
	}
	b, _ := u.take(n)
	if !utf {
		r := make([]rune, len(b))
		for i, c := range b {
			r[i] = rune(c)
		}
		u.push(string(r))
		return nil
	}
	u.push(string(b))
	return nil
}

func (u *unpickler) bytes(size int, what string) error {
	n, err := u.length(size, what)
	if err != nil {
		return err
	}
	b, _ := u.take(n)
	u.push(append([]byte(nil), b...))
	return nil
}

// long pushes the n-byte little-endian two's-complement integer that follows.
func (u *unpickler) long(n int) error {
	if n > len(u.data)-u.pos {
		return fmt.Errorf("LONG of %d bytes, but only %d bytes follow (truncated file?)", n, len(u.data)-u.pos)
	}
	b, _ := u.take(n)
	if n <= 8 {
		var v uint64
		for i := n - 1; i >= 0; i-- {
			v = v<<8 | uint64(b[i])
		}
		if n > 0 && n < 8 && b[n-1]&0x80 != 0 {
			v |= ^uint64(0) << (8 * n) // sign-extend
		}
		u.push(int64(v))
		return nil
	}
	be := make([]byte, n)
	for i := range b {
		be[n-1-i] = b[i]
	}
	v := new(big.Int).SetBytes(be)
	if b[n-1]&0x80 != 0 {
		v.Sub(v, new(big.Int).Lsh(big.NewInt(1), uint(8*n)))
	}
	if v.IsInt64() {
		u.push(v.Int64())
	} else {
		u.push(v)
	}
	return nil
}

// popMark pops the values above the innermost MARK, and the mark, into a
// slice of their own.
func (u *unpickler) popMark() ([]any, error) {
	items, err := u.popMarkView()
	return append([]any(nil), items...), err
}

// popMarkView is popMark for a caller that copies the values out before the
// next push: they stay in the stack's memory, saving a copy for each
// SETITEMS and APPENDS, which is most of a snapshot.
func (u *unpickler) popMarkView() ([]any, error) {
	n := len(u.marks)
	if n == 0 {
		return nil, errors.New("no MARK to pop to")
	}
	at := u.marks[n-1]
	u.marks = u.marks[:n-1]
	items := u.stack[at:]
	u.stack = u.stack[:at]
	return items, nil
}

// appendItems appends the top n values to the list under them.
func (u *unpickler) appendItems(n int) error {
	if len(u.stack)-u.floor() < n+1 {
		return errors.New("APPEND without a list and a value on the stack")
	}
	l, ok := u.stack[len(u.stack)-n-1].(*pyList)
	if !ok {
		return fmt.Errorf("APPEND to a %s, not a list", pyTypeName(u.stack[len(u.stack)-n-1]))
	}
	l.items = append(l.items, u.stack[len(u.stack)-n:]...)
	u.stack = u.stack[:len(u.stack)-n]
	return nil
}

// appendMarked appends the values above the innermost MARK to the list (or
// set) under it: APPENDS and ADDITEMS.
func (u *unpickler) appendMarked() error {
	items, err := u.popMarkView()
	if err != nil {
		return err
	}
	if len(u.stack) == u.floor() {
		return errors.New("APPENDS without a list on the stack")
	}
	l, ok := u.stack[len(u.stack)-1].(*pyList)
	if !ok {
		return fmt.Errorf("APPENDS to a %s, not a list", pyTypeName(u.stack[len(u.stack)-1]))
	}
	l.items = append(l.items, items...)
	return nil
}

func setPairs(d *pyDict, items []any) error {
	if len(items)%2 != 0 {
		return fmt.Errorf("%d values for a dict's keys and values (want pairs)", len(items))
	}
	if n := len(d.keys) + len(items)/2; cap(d.keys) < n {
		d.keys = append(make([]any, 0, n), d.keys...)
		d.vals = append(make([]any, 0, n), d.vals...)
	}
	for i := 0; i < len(items); i += 2 {
		if err := d.set(items[i], items[i+1]); err != nil {
			return err
		}
	}
	return nil
}

// put stores the top of the stack in the memo at index i. Python's pickler
// and torch's number memo entries from 0 up, one per memoized value, so i
// is an index stored before or the next one; anything past that is damage,
// refused before it can make the memo huge.
func (u *unpickler) put(i uint64) error {
	if len(u.stack) == u.floor() {
		return errors.New("PUT on an empty stack")
	}
	switch n := uint64(len(u.memo)); {
	case i < n:
		u.memo[i] = u.stack[len(u.stack)-1]
	case i == n:
		u.memo = append(u.memo, u.stack[len(u.stack)-1])
	default:
		return fmt.Errorf("memo index %d skips ahead of the %d values memoized so far (a damaged pickle)", i, n)
	}
	return nil
}

func (u *unpickler) get(i uint64) error {
	if i >= uint64(len(u.memo)) {
		return fmt.Errorf("memo index %d was never stored (a damaged pickle)", i)
	}
	u.push(u.memo[i])
	return nil
}
