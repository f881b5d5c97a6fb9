package sqsemu

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"time"
)

// installTimeout bounds npm ci; a cold install downloads three small packages.
const installTimeout = 5 * time.Minute

// findDir returns this package's directory (the one holding package.json),
// found by walking up from the working directory to the module root. Tests
// run in their package's directory, which is always inside the module.
func findDir() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for dir := wd; ; {
		candidate := filepath.Join(dir, "internal", "testkit", "sqsemu")
		if _, err := os.Stat(filepath.Join(candidate, "package-lock.json")); err == nil {
			return candidate, nil
		}
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return "", fmt.Errorf("sqsemu: no internal/testkit/sqsemu/package-lock.json under the module root %s", dir)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("sqsemu: no module root above %s", wd)
		}
		dir = parent
	}
}

// ensureInstalled runs npm ci when dir has no node_modules. Several test
// binaries may start at once (go test runs packages in parallel), so npm
// installs into a private temporary directory and the result is renamed into
// place: whichever binary finishes first wins, the others discard their copy.
func ensureInstalled(ctx context.Context, dir string) error {
	target := filepath.Join(dir, "node_modules")
	if _, err := os.Stat(filepath.Join(target, "local-aws-sqs", "package.json")); err == nil {
		return nil
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		return fmt.Errorf("npm is not on the PATH (needed once to install the emulator): %w", err)
	}
	tmp, err := os.MkdirTemp(dir, ".npm-ci-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	for _, name := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(tmp, name), b, 0o644); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, installTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts")
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("npm ci in %s: %w\n%s", tmp, err, out)
	}
	if err := os.Rename(filepath.Join(tmp, "node_modules"), target); err != nil {
		// Another test binary got there first.
		if _, statErr := os.Stat(filepath.Join(target, "local-aws-sqs", "package.json")); statErr == nil {
			return nil
		} else if !errors.Is(statErr, fs.ErrNotExist) {
			return statErr
		}
		return err
	}
	return nil
}
