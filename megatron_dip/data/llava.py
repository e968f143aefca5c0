"""Reader for LLaVA-style data (LLaVA-Pretrain, LLaVA-Instruct), with Pillow for images.

Input: a JSON list (or JSON Lines file) of records

    {"id": "004539375", "image": "00453/004539375.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWrite a short caption."},
                       {"from": "gpt", "value": "a dog on the beach"}]}

`image` is a path relative to the image root (a list of paths for several images; absent for a
text-only record). Each "<image>" tag in the conversation takes the next image, in order.

The file is indexed once by byte offsets (`json_index.JsonRecords`): memory is O(records) small
integers, not the parsed list, and each record is parsed when its metadata or sample is read.
sample_id = the record's index in the file (the JSON id is kept for messages, `record_id`).
Text, loss mask and images follow `image_text` (the run's tokenizer and prompt format; with the
byte tokenizer: BOS, each turn's text with the image runs, a human turn ended by a newline, a gpt
turn by EOS, the loss on gpt turns and their EOS). Every image file is opened and verified when
its metadata is read (the header gives its size; the pixels are decoded only for the sample).

Image paths stay inside the image root: a path that leaves it (`../`, an absolute path) makes its
record bad (an error or a skip) unless `ReaderConfig.allow_outside_paths`
(--dip-allow-outside-paths). The check is on the path as written (normalised, not resolved), so
symbolic links the dataset's owner put inside the root are followed. A record holding a byte
that is not UTF-8 is bad too (`json_index`); in "error" mode the file is refused when it is
opened, naming the first such record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_dip.modelspec import MultimodalSpec

from .chat import llava_turns
from .image_text import ImageTextReader, ReaderConfig, Record
from .json_index import JsonRecords
from .records import BadSampleError, inside_root


@dataclass(frozen=True)
class ImageFile:
    """An image file: size from its header (the file is verified), pixels on `open`."""

    path: Path

    def size(self) -> tuple[int, int]:
        from PIL import Image

        try:
            with Image.open(self.path) as im:
                size = im.size
                im.verify()  # reads the whole file and checks it, without decoding pixels
        except Exception as err:  # Pillow raises many types for broken files
            raise BadSampleError(f"cannot read image {self.path}: {err}") from err
        return size

    def open(self, *, target: tuple[int, int] | None = None):
        from PIL import Image

        from .image import draft

        with Image.open(self.path) as im:
            draft(im, target)  # a huge JPEG decodes at a reduced scale
            return im.copy()  # decoded; converted by the image processor


class LlavaDataset(ImageTextReader):
    """A LLaVA-style JSON file and its image folder, as a `SampleSource` for `BatchStream`."""

    def __init__(
        self,
        json_path: str | Path,
        *,
        model: MultimodalSpec,
        image_root: str | Path | None = None,
        config: ReaderConfig | None = None,
    ) -> None:
        self.json_path = Path(json_path)
        self.image_root = Path(image_root) if image_root is not None else self.json_path.parent
        self.records = JsonRecords(self.json_path)
        config = config or ReaderConfig()
        if config.on_bad_sample == "error":
            self.records.refuse_not_utf8()
        super().__init__(model=model, num_samples=len(self.records), config=config)

    def record_id(self, index: int) -> str:
        """The record's own "id" field (or its index when it has none)."""
        return str(self.records[index].get("id", index))

    def image_paths(self, index: int) -> list[Path]:
        """Absolute paths of the record's images, in order (BadSampleError for a path that
        leaves the image root, unless allowed: module docstring)."""
        allow = self.config.allow_outside_paths
        names = image_names(self.records[index])
        return [inside_root(self.image_root, n, allow_outside=allow) for n in names]

    def describe(self, index: int) -> str:
        where = f"LLaVA record {index} of {self.json_path}"
        if index in self.records.not_utf8:  # it cannot be parsed to name its id
            return where
        image = self.records[index].get("image")
        shown = repr(image)
        if isinstance(image, list) and len(image) > 3:  # keep messages readable
            shown = f"[{image[0]!r}, {image[1]!r}, ... {len(image)} images]"
        return f"{where} (id {self.record_id(index)!r}, image {shown})"

    def record(self, index: int, *, pixels: bool) -> Record:
        del pixels  # files are opened lazily either way
        raw = self.records[index]
        images = tuple(ImageFile(path) for path in self.image_paths(index))
        return Record(llava_turns(raw.get("conversations")), images)


def image_names(record: dict) -> list[str]:
    """The image paths of a LLaVA record (relative to the image root), in order."""
    image = record.get("image")
    names = [] if image is None else [image] if isinstance(image, str) else image
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadSampleError("'image' must be a path or a list of paths")
    return list(names)
