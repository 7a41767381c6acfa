package main

import (
	"encoding/json"
	"fmt"

	"github.com/goalloc/goalloc/caching"
)

// The control functions behind the Python package: statistics, snapshots
// and configuration as JSON. A device not used yet reads as all zeros, as
// torch.cuda.memory_stats does for an untouched device.

func (l *library) checkDevice(d int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.initLocked(0); err != nil {
		return err
	}
	return l.noDeviceLocked(d)
}

// statsJSON is memory_stats(d) with torch's keys, plus goalloc's own.
func (l *library) statsJSON(d int) ([]byte, error) {
	if err := l.checkDevice(d); err != nil {
		return nil, err
	}
	st := caching.Stats{BadInput: map[string]int64{}}
	if a := l.existingDevice(d); a != nil {
		st = a.Stats()
	}
	for k, v := range l.badInputCounts() {
		st.BadInput[k] += v
	}
	return st.JSON(), nil
}

func (l *library) fragmentationJSON(d int) ([]byte, error) {
	if err := l.checkDevice(d); err != nil {
		return nil, err
	}
	var f caching.Fragmentation
	if a := l.existingDevice(d); a != nil {
		f = a.Fragmentation()
	}
	return json.Marshal(f)
}

// snapshotJSON describes device d, or every device made so far when d is -1.
func (l *library) snapshotJSON(d int) ([]byte, error) {
	type deviceSnap struct {
		Device int `json:"device"`
		caching.Snapshot
	}
	var out []deviceSnap
	if d == -1 {
		if err := l.checkDevice(0); err != nil {
			return nil, err
		}
		l.mu.Lock()
		n := l.count
		l.mu.Unlock()
		for i := 0; i < n; i++ {
			s := caching.Snapshot{Segments: []caching.SnapshotSegment{}, Trace: []caching.TraceJSON{}}
			if a := l.existingDevice(i); a != nil {
				s = a.Snapshot()
			}
			out = append(out, deviceSnap{i, s})
		}
	} else {
		if err := l.checkDevice(d); err != nil {
			return nil, err
		}
		s := caching.Snapshot{Segments: []caching.SnapshotSegment{}, Trace: []caching.TraceJSON{}}
		if a := l.existingDevice(d); a != nil {
			s = a.Snapshot()
		}
		out = append(out, deviceSnap{d, s})
	}
	return json.Marshal(out)
}

// configJSON is the configuration in force and what the library runs on.
func (l *library) configJSON() ([]byte, error) {
	if err := l.checkDevice(0); err != nil {
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	limits := map[string]uint64{}
	for i := range l.devices {
		if a := l.devices[i].Load(); a != nil {
			limits[fmt.Sprint(i)] = a.Limit()
		}
	}
	fractions := map[string]float64{}
	for d, f := range l.fractions {
		fractions[fmt.Sprint(d)] = f
	}
	return json.Marshal(map[string]any{
		"conf":         l.cfg.String(),
		"fraction":     l.cfg.Fraction,
		"reserve":      l.cfg.Reserve,
		"large_cache":  l.cfg.LargeCache,
		"large_slack":  l.cfg.LargeSlack,
		"device":       l.kind,
		"device_count": l.count,
		"limits":       limits,
		"fractions":    fractions,
		"history":      l.history.MaxEntries,
		"max_history":  caching.MaxHistoryEntries,
		"error_kinds":  errorKindNames,
		"keys":         caching.ConfigKeys(),
	})
}

func (l *library) resetPeak(d int) error {
	if err := l.checkDevice(d); err != nil {
		return err
	}
	if a := l.existingDevice(d); a != nil {
		return l.fail(a.ResetPeakStats())
	}
	return nil
}

func (l *library) resetAccumulated(d int) error {
	if err := l.checkDevice(d); err != nil {
		return err
	}
	if a := l.existingDevice(d); a != nil {
		a.ResetAccumulatedStats()
	}
	return nil
}

func (l *library) emptyCacheDevice(d int) error {
	if err := l.checkDevice(d); err != nil {
		return err
	}
	if a := l.existingDevice(d); a != nil {
		return l.fail(a.EmptyCache())
	}
	return nil
}

// checkInvariants runs the allocator's full self-check on device d (slow:
// for tests and debugging).
func (l *library) checkInvariants(d int) error {
	if err := l.checkDevice(d); err != nil {
		return err
	}
	if a := l.existingDevice(d); a != nil {
		return l.fail(a.CheckInvariants())
	}
	return nil
}
