"""Export networks nobody here designed, with PyTorch's own ONNX exporter, for benchmarks/models.py.

    python benchmarks/export_models.py --out /tmp/models      # resnet50.onnx, googlenet.onnx, encoder.onnx

- resnet50: torchvision's ResNet-50 architecture written out here (torchvision is not installed), random
  weights, eval mode, BatchNorm left in the graph for edgetune to fold, exported by the TorchScript exporter
  at opset 13 with a symbolic batch dimension (the recipe gives `input_shapes`).
- googlenet: torchvision's GoogLeNet (Inception v1: four-branch blocks concatenated, 3x3 max pools with
  ceil_mode, no auxiliary heads) written out here, random weights, eval mode, BatchNorm and Dropout left in,
  exported at opset 11 with a fixed input shape.
- encoder: int64 token ids -> embedding -> 2-layer nn.TransformerEncoder (4 heads, 256 wide, Dropout left in,
  LayerNorm) -> mean over tokens -> classifier, sequence length 128, opset 17.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, inplanes = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for index in range(blocks):
                layers.append(Bottleneck(inplanes, planes, stride if index == 0 else 1))
                inplanes = planes * 4
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def conv_bn_relu(inputs: int, outputs: int, kernel: int, stride: int = 1, padding: int = 0) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(outputs, eps=0.001), nn.ReLU(inplace=True))


class InceptionBlock(nn.Module):
    def __init__(self, inputs: int, b1: int, b2_reduce: int, b2: int, b3_reduce: int, b3: int, pool: int):
        super().__init__()
        self.branch1 = conv_bn_relu(inputs, b1, 1)
        self.branch2 = nn.Sequential(conv_bn_relu(inputs, b2_reduce, 1), conv_bn_relu(b2_reduce, b2, 3, padding=1))
        self.branch3 = nn.Sequential(conv_bn_relu(inputs, b3_reduce, 1), conv_bn_relu(b3_reduce, b3, 3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True), conv_bn_relu(inputs, pool, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    BLOCKS = {"3a": (192, 64, 96, 128, 16, 32, 32), "3b": (256, 128, 128, 192, 32, 96, 64),
              "4a": (480, 192, 96, 208, 16, 48, 64), "4b": (512, 160, 112, 224, 24, 64, 64),
              "4c": (512, 128, 128, 256, 24, 64, 64), "4d": (512, 112, 144, 288, 32, 64, 64),
              "4e": (528, 256, 160, 320, 32, 128, 128), "5a": (832, 256, 160, 320, 32, 128, 128),
              "5b": (832, 384, 192, 384, 48, 128, 128)}

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(conv_bn_relu(3, 64, 7, 2, 3), nn.MaxPool2d(3, 2, ceil_mode=True),
                                  conv_bn_relu(64, 64, 1), conv_bn_relu(64, 192, 3, padding=1),
                                  nn.MaxPool2d(3, 2, ceil_mode=True))
        stages = []
        for name, sizes in self.BLOCKS.items():
            stages.append(InceptionBlock(*sizes))
            if name in ("3b", "4e"):
                stages.append(nn.MaxPool2d(3 if name == "3b" else 2, 2, ceil_mode=True))
        self.blocks = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1024, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class Encoder(nn.Module):
    def __init__(self, vocabulary: int = 8000, width: int = 256, classes: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.classifier = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(self.embedding(tokens)).mean(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    resnet = ResNet50().eval()
    torch.onnx.export(resnet, (torch.randn(1, 3, 224, 224),), str(args.out / "resnet50.onnx"), dynamo=False,
                      opset_version=13, input_names=["images"], output_names=["logits"],
                      dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    googlenet = GoogLeNet().eval()
    torch.onnx.export(googlenet, (torch.randn(1, 3, 224, 224),), str(args.out / "googlenet.onnx"), dynamo=False,
                      opset_version=11, input_names=["image"], output_names=["logits"],
                      do_constant_folding=False)
    encoder = Encoder().eval()
    torch.onnx.export(encoder, (torch.randint(0, 8000, (1, 128)),), str(args.out / "encoder.onnx"), dynamo=False,
                      opset_version=17, input_names=["tokens"], output_names=["logits"])
    print(f"wrote {', '.join(str(args.out / n) for n in ('resnet50.onnx', 'googlenet.onnx', 'encoder.onnx'))}")


if __name__ == "__main__":
    main()
