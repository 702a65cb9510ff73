package main

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// One tar code path serves all three data operations:
//
//	snapshot = writeTar(volume) -> gzip -> file
//	restore  = file -> gunzip -> extractTar(new volume)
//	clone    = writeTar(volume) -> pipe -> extractTar(new volume)
//
// Regular files, directories and symlinks are kept with their modes and modification
// times; hard links become separate copies and ownership is not preserved (the local
// stack runs as one user). Files are read while the volume may be in use: a snapshot is
// as consistent as the workspace is at that moment, like a copy with tar would be.

// writeTar writes the tree under dir to w, paths relative to dir.
func writeTar(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return skipVanished(err)
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil || rel == "." {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return skipVanished(err) // removed (or renamed away) since the listing
		}
		// A regular file is opened first and described by what was opened: a writer that
		// replaces it (temp file, then rename) between the listing and the read cannot give
		// the archive the old file's size with the new file's bytes.
		var f *os.File
		if info.Mode().IsRegular() {
			if f, err = os.Open(path); err != nil {
				return skipVanished(err)
			}
			defer f.Close()
			if info, err = f.Stat(); err != nil {
				return err
			}
		}
		link := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(path); err != nil {
				return err
			}
		} else if !info.Mode().IsRegular() && !info.IsDir() {
			return nil // sockets, fifos and devices have no content to keep
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if f == nil {
			return nil
		}
		// CopyN: a file that grows while we read it must not overrun its header's size.
		_, err = io.CopyN(tw, f, hdr.Size)
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// skipVanished lets the walk go on past an entry that is gone by the time it is read.
func skipVanished(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// extractTar unpacks r into dir, which must exist. os.Root confines every write to dir,
// so an entry named ../x or one that walks through a symlink cannot escape it.
func extractTar(r io.Reader, dir string) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(r)
	type dirTime struct {
		name string
		hdr  *tar.Header
	}
	var dirs []dirTime
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		name := filepath.FromSlash(hdr.Name)
		mode := fs.FileMode(hdr.Mode) & fs.ModePerm
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, 0o755); err != nil {
				return err
			}
			// Set directory modes and times last: writing into a directory changes its mtime.
			dirs = append(dirs, dirTime{name, hdr})
		case tar.TypeReg:
			if err := root.MkdirAll(filepath.Dir(name), 0o755); err != nil {
				return err
			}
			f, err := root.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
			if err := root.Chmod(name, mode); err != nil { // OpenFile's mode is masked by umask
				return err
			}
			if err := root.Chtimes(name, hdr.ModTime, hdr.ModTime); err != nil {
				return err
			}
		case tar.TypeSymlink:
			if err := root.MkdirAll(filepath.Dir(name), 0o755); err != nil {
				return err
			}
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return err
			}
		default:
			return fmt.Errorf("archive entry %s: unsupported type %q", hdr.Name, hdr.Typeflag)
		}
	}
	for i := len(dirs) - 1; i >= 0; i-- { // deepest first, so parents keep their times
		d := dirs[i]
		if err := root.Chmod(d.name, fs.FileMode(d.hdr.Mode)&fs.ModePerm); err != nil {
			return err
		}
		if err := root.Chtimes(d.name, d.hdr.ModTime, d.hdr.ModTime); err != nil {
			return err
		}
	}
	return nil
}

// archiveDir writes dir as a gzip-compressed tar to path and returns its size. It
// writes to a temporary name and renames, so path only ever holds a whole archive.
func archiveDir(dir, tmp, path string) (int64, error) {
	f, err := os.Create(tmp)
	if err != nil {
		return 0, err
	}
	defer os.Remove(tmp) // no-op after the rename
	// BestSpeed: workspaces are often already-compressed or random data, where higher
	// levels cost several times the CPU for a few percent.
	gz, _ := gzip.NewWriterLevel(f, gzip.BestSpeed)
	err = writeTar(dir, gz)
	if err == nil {
		err = gz.Close()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return 0, err
	}
	info, err := os.Stat(tmp)
	if err != nil {
		return 0, err
	}
	return info.Size(), os.Rename(tmp, path)
}

// restoreArchive fills the new directory dir from the archive at path.
func restoreArchive(path, dir string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		return err
	}
	return extractTar(gz, dir)
}

// copyDir fills the new directory dst with a copy of src, streaming through a pipe.
func copyDir(src, dst string) error {
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(src, pw)) }()
	err := extractTar(pr, dst)
	pr.CloseWithError(err) // unblocks the writer if extraction stopped early
	return err
}
