package main

// Memory tags, sleep and wake through the C ABI (goalloc.h, "Sleep and
// wake"): the caching layer's half is caching/sleep.go, the placement's
// arena's vmm_sleep.go, Note [Sleep and wake].

/*
#include "cgo.h"
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
)

//export goalloc_set_memory_tag
func goalloc_set_memory_tag(name *C.goalloc_const_char) C.int {
	s := ""
	if name != nil {
		s = C.GoString(name)
	}
	return status(lib.setMemoryTag(s))
}

//export goalloc_memory_tag
func goalloc_memory_tag() *C.char { return C.CString(caching.TagName(threadTag())) }

//export goalloc_sleep
func goalloc_sleep(device C.int, offloadTags *C.goalloc_const_char) *C.char {
	var offload string
	if offloadTags != nil {
		offload = C.GoString(offloadTags)
	}
	return cstring(lib.sleep(int(device), offload))
}

//export goalloc_wake_up
func goalloc_wake_up(device C.int, tags *C.goalloc_const_char) *C.char {
	var names *string
	if tags != nil {
		s := C.GoString(tags)
		names = &s
	}
	return cstring(lib.wakeUp(int(device), names))
}

//export goalloc_prepare_sleep
func goalloc_prepare_sleep(device C.int, size C.ulonglong) C.int {
	return status(lib.prepareSleep(int(device), uint64(size)))
}

//export goalloc_sleep_state_json
func goalloc_sleep_state_json(device C.int) *C.char { return cstring(lib.sleepStateJSON(int(device))) }

// setMemoryTag is goalloc_set_memory_tag: the calling thread's allocations
// carry the tag name from now on ("": untagged).
func (l *library) setMemoryTag(name string) error {
	if name == "" {
		setThreadTag(0)
		return nil
	}
	t, err := caching.InternTag(name)
	if err != nil {
		return l.fail(withKind(errBadArgument, err))
	}
	l.useTags()
	setThreadTag(t)
	return nil
}

// useTags marks memory tags in use, before the first tagged allocation:
// every device's front goes off for good (caching.SetTagsInUse), now and
// as each later device is made (device, under l.mu too).
func (l *library) useTags() {
	if l.tagsUsed.Load() {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, a := range l.existing() {
		a.SetTagsInUse()
	}
	l.tagsUsed.Store(true)
}

// allocTag is the memory tag of the allocation the calling thread makes:
// its thread's, once a tag was set in the process (reading it is a call
// into C).
func (l *library) allocTag() caching.Tag {
	if !l.tagsUsed.Load() {
		return 0
	}
	return threadTag()
}

// namedTags is the tags a comma-separated list names ("": none); a name no
// thread ever set is refused, as is a list that names one twice.
func (l *library) namedTags(list, what string) ([]caching.Tag, error) {
	if list == "" {
		return nil, nil
	}
	var out []caching.Tag
	for _, name := range strings.Split(list, ",") {
		t, ok := caching.LookupTag(name)
		if !ok {
			return nil, l.fail(withKind(errBadArgument, fmt.Errorf("goalloc: %s: memory tag %q is unknown: no allocation was tagged with it (goalloc.memory_tag)", what, name)))
		}
		if slices.Contains(out, t) {
			return nil, l.fail(withKind(errBadArgument, fmt.Errorf("goalloc: %s: memory tag %q is named twice", what, name)))
		}
		out = append(out, t)
	}
	return out, nil
}

// sleepDevices is the allocators a sleep or wake of device d reaches: every
// device made so far for -1, else d's (none where goalloc holds nothing).
// It refuses a device that does not exist, and backend:async.
func (l *library) sleepDevices(d int, what string) ([]*caching.Allocator, error) {
	probe := d
	if d == -1 {
		probe = 0
	}
	if err := l.checkDevice(probe); err != nil {
		return nil, err
	}
	l.mu.Lock()
	backend := l.cfg.Backend
	l.mu.Unlock()
	if backend != arena.BackendVMM {
		return nil, l.fail(fmt.Errorf("goalloc: %s: %w", what, caching.ErrNeedsVMM))
	}
	var out []*caching.Allocator
	if d == -1 {
		for i := range l.devices {
			if a := l.devices[i].Load(); a != nil {
				out = append(out, a)
			}
		}
	} else if a := l.existingDevice(d); a != nil {
		out = append(out, a)
	}
	return out, nil
}

// prepareSleep is goalloc_prepare_sleep: at least size bytes of pinned host
// memory kept for the offloads of device d (-1: of every device goalloc has
// made; a device named is made if it was not).
func (l *library) prepareSleep(d int, size uint64) error {
	if size > caching.MaxRequest {
		return l.fail(withKind(errBadArgument, fmt.Errorf("goalloc: prepare_sleep of %d bytes of host memory: more than any request goalloc takes (%d)", size, uint64(caching.MaxRequest))))
	}
	devs, err := l.sleepDevices(d, "prepare_sleep")
	if err != nil {
		return err
	}
	if d != -1 && len(devs) == 0 {
		a, err := l.device(d)
		if err != nil {
			return err
		}
		devs = append(devs, a)
	}
	for _, a := range devs {
		if _, err := a.PrepareSleep(size); err != nil {
			return l.fail(err)
		}
	}
	return nil
}

// sleep is goalloc_sleep: every memory tag of device d (-1: of every
// device) to sleep, those of the list offload copied to the host first.
// Nothing happens when a device is asleep already.
func (l *library) sleep(d int, offload string) ([]byte, error) {
	devs, err := l.sleepDevices(d, "sleep")
	if err != nil {
		return nil, err
	}
	tags, err := l.namedTags(offload, "sleep")
	if err != nil {
		return nil, err
	}
	for _, a := range devs {
		if asleep := a.AsleepTags(); asleep != nil {
			return nil, l.fail(&caching.StateError{Msg: fmt.Sprintf("sleep on device %d, where memory tags %s are asleep: wake_up them first", a.Device().Ordinal(), names(asleep))})
		}
	}
	res := struct {
		Offloaded uint64  `json:"offloaded_bytes"`
		Released  uint64  `json:"released_bytes"`
		Prepare   float64 `json:"prepare_seconds"`
		Offload   float64 `json:"offload_seconds"`
		Devices   []int   `json:"devices"`
	}{Devices: []int{}}
	for _, a := range devs {
		r, err := a.Sleep(tags)
		if err != nil {
			return nil, l.fail(err)
		}
		res.Offloaded += r.Offloaded
		res.Released += r.Released
		res.Prepare += r.Prepare.Seconds()
		res.Offload += r.Offload.Seconds()
		res.Devices = append(res.Devices, a.Device().Ordinal())
	}
	return json.Marshal(res)
}

// wakeUp is goalloc_wake_up: the tags of the list (nil: every tag asleep)
// awake again on device d (-1: on every device where one of them is
// asleep). Out of memory stops at the tag that does not fit.
func (l *library) wakeUp(d int, list *string) ([]byte, error) {
	devs, err := l.sleepDevices(d, "wake_up")
	if err != nil {
		return nil, err
	}
	var tags []caching.Tag
	if list != nil {
		if tags, err = l.namedTags(*list, "wake_up"); err != nil {
			return nil, err
		}
		if tags == nil {
			return nil, l.fail(withKind(errBadArgument, errors.New("goalloc: wake_up: no memory tag named; give NULL to wake every tag asleep")))
		}
	}
	var asleep []*caching.Allocator
	for _, a := range devs {
		if at := a.AsleepTags(); at != nil && (tags == nil || slices.ContainsFunc(tags, func(t caching.Tag) bool { return slices.Contains(at, t) })) {
			asleep = append(asleep, a)
		}
	}
	if asleep == nil {
		where := "on any device"
		if d != -1 {
			where = fmt.Sprintf("on device %d", d)
		}
		what := "nothing is asleep " + where + ": sleep first"
		if tags != nil {
			what = fmt.Sprintf("memory tags %s are not asleep %s", names(tags), where)
		}
		return nil, l.fail(&caching.StateError{Msg: "wake_up: " + what})
	}
	res := struct {
		Mapped   uint64   `json:"mapped_bytes"`
		Restored uint64   `json:"restored_bytes"`
		Map      float64  `json:"map_seconds"`
		Restore  float64  `json:"restore_seconds"`
		Woken    []string `json:"woken"`
		Devices  []int    `json:"devices"`
	}{Woken: []string{}, Devices: []int{}}
	for _, a := range asleep {
		r, err := a.Wake(tags)
		if err != nil {
			return nil, l.fail(err)
		}
		res.Mapped += r.Mapped
		res.Restored += r.Restored
		res.Map += r.Map.Seconds()
		res.Restore += r.Restore.Seconds()
		for _, t := range r.Woken {
			if n := caching.TagName(t); !slices.Contains(res.Woken, n) {
				res.Woken = append(res.Woken, n)
			}
		}
		res.Devices = append(res.Devices, a.Device().Ordinal())
	}
	return json.Marshal(res)
}

// sleepStateJSON is goalloc_sleep_state_json: device d's memory tags, what
// is asleep, and the host memory kept for it.
func (l *library) sleepStateJSON(d int) ([]byte, error) {
	if err := l.checkDevice(d); err != nil {
		return nil, err
	}
	type tagJSON struct {
		Reserved uint64 `json:"reserved_bytes"`
		Asleep   bool   `json:"asleep"`
	}
	out := struct {
		Device    int                `json:"device"`
		Tags      map[string]tagJSON `json:"tags"`
		Asleep    []string           `json:"asleep"`
		Offloaded uint64             `json:"offloaded_bytes"`
		HostArea  uint64             `json:"host_area_bytes"`
	}{Device: d, Tags: map[string]tagJSON{}, Asleep: []string{}}
	if a := l.existingDevice(d); a != nil {
		info := a.SleepInfo()
		for _, ts := range info.Tags {
			name := caching.TagName(ts.Tag)
			out.Tags[name] = tagJSON{Reserved: ts.Reserved, Asleep: ts.Asleep}
			if ts.Asleep {
				out.Asleep = append(out.Asleep, name)
			}
		}
		out.Offloaded, out.HostArea = info.Offloaded, info.HostArea
	}
	return json.Marshal(out)
}

// names is the tags' names, quoted, for messages.
func names(tags []caching.Tag) string {
	var out []string
	for _, t := range tags {
		out = append(out, fmt.Sprintf("%q", caching.TagName(t)))
	}
	return strings.Join(out, ", ")
}
